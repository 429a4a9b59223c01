package podnet_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/nodeagent/podnet"
)

const (
	testBridge = "pntest0"
	uplinkAddr = "198.51.100.1"
	outerAddr  = "198.51.100.2"
)

func testConfig(t *testing.T, stateDir string) podnet.Config {
	t.Helper()
	resolv := filepath.Join(t.TempDir(), "resolv.conf")
	conf := "# test\nnameserver 127.0.0.53\nnameserver 192.0.2.53\nsearch example.test corp.example\n"
	if err := os.WriteFile(resolv, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	return podnet.Config{
		Bridge:     testBridge,
		CIDR:       "10.244.0.0/24",
		StateDir:   stateDir,
		ResolvConf: resolv,
		Log:        slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
}

// serve runs n's DHCP server until the returned stop is called.
func serve(t *testing.T, n *podnet.Network) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("dhcp server: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("dhcp server did not stop with its context")
		}
	}
	t.Cleanup(stop)
	return stop
}

// TestPodNetwork follows one guest through the pod network's life: Ensure,
// DHCP, the gateway, masquerade to the outside, an agent restart,
// Detach and Teardown.
func TestPodNetwork(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	if got := readSysctl(t, "net/ipv4/ip_forward"); got != "0" {
		t.Fatalf("node namespace starts with ip_forward=%s", got)
	}

	// The outside world: a namespace behind the node's uplink.
	outside := newNS(t, "pn-out")
	vethInto(t, "up0", "out0", outside, nil, outerAddr+"/24")
	up, _ := netlink.LinkByName("up0")
	a, _ := netlink.ParseAddr(uplinkAddr + "/24")
	if err := netlink.AddrAdd(up, a); err != nil {
		t.Fatal(err)
	}

	// A table of someone else's that Teardown must leave alone.
	if out, err := exec.Command("nft", "add", "table", "inet", "someone_else").CombinedOutput(); err != nil {
		t.Fatalf("nft: %v %s", err, out)
	}

	stateDir := filepath.Join(t.TempDir(), "podnet")
	cfg := testConfig(t, stateDir)
	n, err := podnet.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for range 2 { // idempotent
		if err := n.Ensure(ctx); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("Ensure x2: %s", time.Since(start))
	if got := readSysctl(t, "net/ipv4/ip_forward"); got != "1" {
		t.Fatalf("ip_forward=%s after Ensure", got)
	}
	if nftList(t, "inet") == "" || nftList(t, "bridge") == "" {
		t.Fatal("nftables tables missing after Ensure")
	}
	stopServer := serve(t, n)

	// The guest: a namespace whose NIC reaches the tap through a relay.
	mac, _ := net.ParseMAC("02:00:0a:f4:00:01")
	start = time.Now()
	_, ip, err := n.Attach(ctx, "default/vm-one", "pntap1", mac, -1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Attach: %s, ip %s", time.Since(start), ip)
	if !n.Subnet().Contains(ip) || ip.Equal(n.Gateway()) {
		t.Fatalf("allocated %s, not a guest address of %s", ip, n.Subnet())
	}
	tap, err := netlink.LinkByName("pntap1")
	if err != nil {
		t.Fatal(err)
	}
	br, _ := netlink.LinkByName(testBridge)
	if tap.Attrs().MasterIndex != br.Attrs().Index {
		t.Fatalf("tap not on %s", testBridge)
	}
	guest := newNS(t, "pn-vm")
	relay := startRelay(t, "pntap1", guest, "eth0", mac)

	start = time.Now()
	lease, ok := runUDHCPC(t, guest, "eth0", 5)
	if !ok {
		t.Fatal("guest got no DHCP lease")
	}
	took := time.Since(start)
	want := map[string]string{
		"ip": ip.String(), "router": "10.244.0.1", "subnet": "255.255.255.0", "mask": "24",
		"dns": "192.0.2.53", "lease": "86400", "hostname": "vm-one", "mtu": "1500",
		"domain": "example.test", "search": "example.test corp.example", "serverid": "10.244.0.1",
	}
	for k, v := range want {
		if got := strings.TrimSpace(lease[k]); got != v {
			t.Errorf("lease %s = %q, want %q", k, got, v)
		}
	}
	t.Logf("DHCP lease in %s: ip %s router %s dns %s", took, lease["ip"], lease["router"], lease["dns"])
	if got := n.Lease(mac); !got.Equal(ip) {
		t.Fatalf("Lease(%s) = %v, want %s", mac, got, ip)
	}

	if out, err := guest.Run(ctx, "busybox", "ping", "-c", "1", "-W", "3", "10.244.0.1"); err != nil {
		t.Fatalf("guest cannot ping the gateway: %v %s", err, out)
	}
	// Traffic to the outside leaves with the node's address ...
	l := listenIn(t, outside, outerAddr+":8080")
	if src := peerOf(t, guest, l, outerAddr+":8080"); !src.Equal(net.ParseIP(uplinkAddr)) {
		t.Fatalf("outside saw source %s, want the masqueraded %s", src, uplinkAddr)
	}
	// ... traffic to the node inside the subnet keeps the guest's.
	gl, err := net.Listen("tcp4", "10.244.0.1:8081")
	if err != nil {
		t.Fatal(err)
	}
	defer gl.Close()
	if src := peerOf(t, guest, gl, "10.244.0.1:8081"); !src.Equal(ip) {
		t.Fatalf("gateway saw source %s, want the guest's own %s", src, ip)
	}

	// The guest cannot use another address or MAC: its tap is pinned.
	// Static neighbour entries on both sides take ARP (whose own rules
	// would also stop these) out of the picture, so each check hits the
	// rule it is about.
	gwMAC := br.Attrs().HardwareAddr.String()
	if _, err := guest.Run(ctx, "ip", "neigh", "replace", "10.244.0.1", "lladdr", gwMAC, "dev", "eth0", "nud", "permanent"); err != nil {
		t.Fatal(err)
	}
	if _, err := guest.Run(ctx, "ip", "addr", "add", "10.244.0.200/24", "dev", "eth0"); err != nil {
		t.Fatal(err)
	}
	setNeigh(t, "10.244.0.200", mac.String())
	err = guest.Do(func() error {
		d := net.Dialer{Timeout: 1500 * time.Millisecond, LocalAddr: &net.TCPAddr{IP: net.ParseIP("10.244.0.200")}}
		c, err := d.Dial("tcp4", "10.244.0.1:8081")
		if err == nil {
			c.Close()
		}
		return err
	})
	if err == nil {
		t.Fatal("a connection from a spoofed source address got through")
	}
	if _, err := guest.Run(ctx, "ip", "addr", "del", "10.244.0.200/24", "dev", "eth0"); err != nil {
		t.Fatal(err)
	}
	forged := "02:00:0a:f4:00:99"
	if _, err := guest.Run(ctx, "ip", "link", "set", "eth0", "address", forged); err != nil {
		t.Fatal(err)
	}
	setNeigh(t, ip.String(), forged)
	if _, err := guest.Run(ctx, "ip", "neigh", "replace", "10.244.0.1", "lladdr", gwMAC, "dev", "eth0", "nud", "permanent"); err != nil {
		t.Fatal(err)
	}
	if out, err := guest.Run(ctx, "busybox", "ping", "-c", "1", "-W", "1", "10.244.0.1"); err == nil {
		t.Fatalf("a guest with a forged MAC pinged the gateway: %s", out)
	}
	if _, err := guest.Run(ctx, "ip", "link", "set", "eth0", "address", mac.String()); err != nil {
		t.Fatal(err)
	}
	setNeigh(t, ip.String(), mac.String())
	if out, err := guest.Run(ctx, "busybox", "ping", "-c", "1", "-W", "3", "10.244.0.1"); err != nil {
		t.Fatalf("guest cannot ping the gateway with its MAC back: %v %s", err, out)
	}

	// An agent restart: a new Network on the same state hands out the
	// same address, to Lease and over DHCP, and re-adopts the tap.
	stopServer()
	n2, err := podnet.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := n2.Lease(mac); !got.Equal(ip) {
		t.Fatalf("after restart Lease = %v, want %s", got, ip)
	}
	if err := n2.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	_, again, err := n2.Attach(ctx, "default/vm-one", "pntap1", mac, -1)
	if err != nil || !again.Equal(ip) {
		t.Fatalf("re-Attach after restart = %v, %v; want %s", again, err, ip)
	}
	serve(t, n2)
	lease, ok = runUDHCPC(t, guest, "eth0", 5)
	if !ok || lease["ip"] != ip.String() {
		t.Fatalf("after restart the guest got %v (ok %v), want %s", lease["ip"], ok, ip)
	}

	// A second guest gets another address; an unattached MAC gets none.
	mac2, _ := net.ParseMAC("02:00:0a:f4:00:02")
	_, ip2, err := n2.Attach(ctx, "default/vm-two", "pntap2", mac2, 107)
	if err != nil {
		t.Fatal(err)
	}
	if ip2.Equal(ip) {
		t.Fatalf("two guests share %s", ip)
	}
	stranger := newNS(t, "pn-x")
	vethInto(t, "rlx", "eth0", stranger, nil, "")
	rlx, _ := netlink.LinkByName("rlx")
	if err := netlink.LinkSetMaster(rlx, br); err != nil {
		t.Fatal(err)
	}
	if lease, ok := runUDHCPC(t, stranger, "eth0", 2); ok {
		t.Fatalf("a MAC never attached got a lease: %v", lease)
	}

	// Detach releases the address and removes the tap.
	relay.stop()
	if err := n2.Detach(ctx, "default/vm-one", "pntap1"); err != nil {
		t.Fatal(err)
	}
	if err := n2.Detach(ctx, "default/vm-one", "pntap1"); err != nil {
		t.Fatalf("second Detach: %v", err)
	}
	if linkExists("pntap1") {
		t.Fatal("tap left after Detach")
	}
	if got := n2.Lease(mac); got != nil {
		t.Fatalf("Lease after Detach = %s", got)
	}
	if got := len(n2.Attachments()); got != 1 {
		t.Fatalf("%d attachments after Detach, want 1", got)
	}
	if rules := nftList(t, "bridge"); strings.Contains(rules, "pntap1") || !strings.Contains(rules, "pntap2") {
		t.Fatalf("after Detach of pntap1 the anti-spoofing rules are:\n%s", rules)
	}

	// Teardown removes the second guest's tap, the bridge, the table,
	// forwarding and the state.
	if err := n2.Teardown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n2.Teardown(ctx); err != nil {
		t.Fatalf("second Teardown: %v", err)
	}
	for _, name := range []string{testBridge, "pntap2"} {
		if linkExists(name) {
			t.Errorf("%s left after Teardown", name)
		}
	}
	if nftList(t, "inet") != "" || nftList(t, "bridge") != "" {
		t.Error("nftables tables left after Teardown")
	}
	if out, err := exec.Command("nft", "list", "tables").CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "table inet someone_else" {
		t.Errorf("tables after Teardown: %q, %v; want only someone_else's", out, err)
	}
	if out, err := exec.Command("nft", "delete", "table", "inet", "someone_else").CombinedOutput(); err != nil {
		t.Fatalf("nft: %v %s", err, out)
	}
	if got := readSysctl(t, "net/ipv4/ip_forward"); got != "0" {
		t.Errorf("ip_forward=%s after Teardown, want 0 as found", got)
	}
	if _, err := os.Stat(stateDir); !os.IsNotExist(err) {
		t.Errorf("state dir left after Teardown: %v", err)
	}
	if _, _, err := n2.Attach(ctx, "default/vm-three", "pntap3", mac, -1); err == nil || linkExists("pntap3") {
		t.Errorf("Attach without Ensure: err %v, tap made %v", err, linkExists("pntap3"))
	}
}

// TestEnsureRefusesOverlap: a subnet colliding with an address the node
// has elsewhere is refused before anything is made.
func TestEnsureRefusesOverlap(t *testing.T) {
	d := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "pnother0"}}
	if err := netlink.LinkAdd(d); err != nil {
		t.Fatal(err)
	}
	defer netlink.LinkDel(d)
	a, _ := netlink.ParseAddr("10.99.0.5/16")
	if err := netlink.AddrAdd(d, a); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, t.TempDir())
	cfg.Bridge, cfg.CIDR = "pnoverlap0", "10.99.3.0/24"
	n, err := podnet.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = n.Ensure(context.Background())
	if err == nil || !strings.Contains(err.Error(), "overlaps") {
		t.Fatalf("Ensure = %v, want an overlap error", err)
	}
	if linkExists("pnoverlap0") {
		t.Fatal("bridge made despite the overlap")
	}
}

func TestNewValidates(t *testing.T) {
	for _, c := range []podnet.Config{
		{CIDR: "10.0.0.0/30"},
		{CIDR: "10.0.0.1/24"},
		{CIDR: "fd00::/64"},
		{CIDR: "nonsense"},
		{Bridge: "a-name-far-too-long-for-linux"},
		{MTU: 100},
		{DNS: []net.IP{net.ParseIP("fd00::1")}},
	} {
		c.StateDir = t.TempDir()
		if _, err := podnet.New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
}

// TestConcurrentAttach: attachments made at the same time get distinct
// addresses, and Teardown removes every tap.
func TestConcurrentAttach(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := testConfig(t, t.TempDir())
	cfg.Bridge, cfg.CIDR = "pnconc0", "10.245.0.0/27"
	n, err := podnet.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	const count = 16
	ips := make([]net.IP, count)
	errs := make([]error, count)
	var wg sync.WaitGroup
	for i := range count {
		wg.Go(func() {
			mac := net.HardwareAddr{2, 0, 0, 0, 2, byte(i)}
			_, ips[i], errs[i] = n.Attach(ctx, fmt.Sprintf("ns/vm%d", i), fmt.Sprintf("pnc%d", i), mac, -1)
		})
	}
	wg.Wait()
	seen := map[string]bool{}
	for i := range count {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if seen[ips[i].String()] || !n.Subnet().Contains(ips[i]) {
			t.Fatalf("address %s duplicated or outside the subnet", ips[i])
		}
		seen[ips[i].String()] = true
	}
	if err := n.Teardown(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range count {
		if linkExists(fmt.Sprintf("pnc%d", i)) {
			t.Fatalf("tap pnc%d left after Teardown", i)
		}
	}
}

// TestTwoNetworksShareForwarding: two pod networks of one namespace keep
// their own tables, and forwarding stays on until the last one goes.
func TestTwoNetworksShareForwarding(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if got := readSysctl(t, "net/ipv4/ip_forward"); got != "0" {
		t.Fatalf("node namespace starts with ip_forward=%s", got)
	}
	nets := make([]*podnet.Network, 2)
	for i, br := range []string{"pn-two-a", "pntwob"} {
		cfg := testConfig(t, t.TempDir())
		cfg.Bridge, cfg.CIDR = br, fmt.Sprintf("10.246.%d.0/24", i)
		n, err := podnet.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.Ensure(ctx); err != nil {
			t.Fatal(err)
		}
		nets[i] = n
	}
	a, b := podnet.TableName("pn-two-a"), podnet.TableName("pntwob")
	if a == b || strings.ContainsAny(a, "-") {
		t.Fatalf("table names %q and %q: want distinct nft identifiers", a, b)
	}
	for _, table := range []string{a, b} {
		if out, err := exec.Command("nft", "list", "table", "inet", table).CombinedOutput(); err != nil {
			t.Fatalf("table %s: %v: %s", table, err, out)
		}
	}
	if err := nets[0].Teardown(ctx); err != nil {
		t.Fatal(err)
	}
	if got := readSysctl(t, "net/ipv4/ip_forward"); got != "1" {
		t.Fatalf("ip_forward=%s after the first Teardown, want 1 while another pod network remains", got)
	}
	if out, err := exec.Command("nft", "list", "table", "inet", b).CombinedOutput(); err != nil {
		t.Fatalf("the first Teardown took the other network's table: %v: %s", err, out)
	}
	if err := nets[1].Teardown(ctx); err != nil {
		t.Fatal(err)
	}
	if got := readSysctl(t, "net/ipv4/ip_forward"); got != "0" {
		t.Fatalf("ip_forward=%s after the last Teardown, want 0 as found", got)
	}
}
