package podnet_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/nodevirt/nodevirt/cni/cnitest"
	"github.com/nodevirt/nodevirt/nodeagent/podnet"
)

// inNodeNS marks the re-executed test binary.
const inNodeNS = "NODEVIRT_PODNET_TEST_NODE_NETNS"

// TestMain re-runs the test binary in a network namespace of its own, which
// stands in for the node: the code under test works on "the host's"
// interfaces, sysctls and nftables tables, and those of this namespace are
// throwaway. Guests and the outside world are further namespaces.
func TestMain(m *testing.M) {
	if os.Geteuid() != 0 {
		fmt.Println("podnet tests need root (network namespaces)")
		os.Exit(1)
	}
	if os.Getenv(inNodeNS) == "" {
		cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
		cmd.Env = append(os.Environ(), inNodeNS+"=1")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
		err := cmd.Run()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			os.Exit(exit.ExitCode())
		}
		if err != nil {
			fmt.Println("re-run tests in a new network namespace:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if err := linkUp("lo"); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	// A new namespace copies the host's IPv4 sysctls, so forwarding is
	// on here whenever it is on the host: start from the kernel default.
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("0"), 0o644); err != nil {
		fmt.Println("reset ip_forward:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

func linkUp(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("look up %s: %w", name, err)
	}
	return netlink.LinkSetUp(l)
}

// newNS makes a namespace removed when the test ends, with lo up.
func newNS(t *testing.T, prefix string) *cnitest.NS {
	t.Helper()
	ns, err := cnitest.NewNS(prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ns.Close() })
	if err := ns.Do(func() error { return linkUp("lo") }); err != nil {
		t.Fatal(err)
	}
	return ns
}

// vethInto makes a veth pair: local stays in the node namespace, peer goes
// into ns with mac (nil: the kernel's) and addr (empty: none), both up.
func vethInto(t *testing.T, local, peer string, ns *cnitest.NS, mac net.HardwareAddr, addr string) {
	t.Helper()
	nsh, err := os.Open(ns.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer nsh.Close()
	v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: local}, PeerName: peer, PeerHardwareAddr: mac}
	if err := netlink.LinkAdd(v); err != nil {
		t.Fatalf("veth %s/%s: %v", local, peer, err)
	}
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(local); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	p, err := netlink.LinkByName(peer)
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetNsFd(p, int(nsh.Fd())); err != nil {
		t.Fatal(err)
	}
	if err := linkUp(local); err != nil {
		t.Fatal(err)
	}
	err = ns.Do(func() error {
		l, err := netlink.LinkByName(peer)
		if err != nil {
			return err
		}
		if addr != "" {
			a, err := netlink.ParseAddr(addr)
			if err != nil {
				return err
			}
			if err := netlink.AddrAdd(l, a); err != nil {
				return err
			}
		}
		return netlink.LinkSetUp(l)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// relay stands in for QEMU: it opens the tap as a VM would and copies
// Ethernet frames between it and a veth whose peer is the guest's NIC, so a
// DHCP client and ping in the guest's namespace act like the guest OS. The
// relay's end of the veth lives in a namespace of its own: in the node's,
// the node would answer the guest's ARP on it and bypass the tap.
type relay struct {
	tap, port *os.File
	wg        sync.WaitGroup
}

func startRelay(t *testing.T, tap string, guest *cnitest.NS, guestIf string, mac net.HardwareAddr) *relay {
	t.Helper()
	wire := newNS(t, "pn-wire")
	port := "w" + tap
	vethInto(t, port, guestIf, guest, mac, "")
	wh, err := os.Open(wire.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer wh.Close()
	pl, err := netlink.LinkByName(port)
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetNsFd(pl, int(wh.Fd())); err != nil {
		t.Fatal(err)
	}

	tfd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	ifr, err := unix.NewIfreq(tap)
	if err != nil {
		t.Fatal(err)
	}
	// Both ends carry a virtio_net_hdr, as QEMU's tap backend does, so
	// offloaded checksums (CHECKSUM_PARTIAL from the guest's veth) and
	// GSO survive the relay instead of leaving with unfinished checksums
	// that conntrack would call invalid.
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(tfd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(tfd)
		t.Fatalf("open tap %s: %v", tap, err)
	}
	var pfd int
	err = wire.Do(func() error {
		l, err := netlink.LinkByName(port)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		proto := htons(unix.ETH_P_ALL)
		if pfd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, int(proto)); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(pfd, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1); err != nil {
			return err
		}
		return unix.Bind(pfd, &unix.SockaddrLinklayer{Protocol: proto, Ifindex: l.Attrs().Index})
	})
	if err != nil {
		t.Fatalf("relay port: %v", err)
	}
	r := &relay{tap: os.NewFile(uintptr(tfd), tap), port: os.NewFile(uintptr(pfd), port)}
	r.wg.Add(2)
	go func() { // guest → tap: what the guest's NIC sends
		defer r.wg.Done()
		rc, err := r.port.SyscallConn()
		if err != nil {
			return
		}
		buf := make([]byte, 65536)
		for {
			var n int
			var from unix.Sockaddr
			var rerr error
			err := rc.Read(func(fd uintptr) bool {
				n, from, rerr = unix.Recvfrom(int(fd), buf, 0)
				return rerr != unix.EAGAIN
			})
			if err != nil || (rerr != nil && rerr != unix.EINTR) {
				return
			}
			if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
				continue
			}
			if n > 0 {
				_, _ = r.tap.Write(buf[:n])
			}
		}
	}()
	go func() { // tap → guest
		defer r.wg.Done()
		buf := make([]byte, 65536)
		for {
			n, err := r.tap.Read(buf)
			if err != nil {
				return
			}
			_, _ = r.port.Write(buf[:n])
		}
	}()
	t.Cleanup(r.stop)
	return r
}

func (r *relay) stop() {
	r.tap.Close()
	r.port.Close()
	r.wg.Wait()
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// dhcpLease is what busybox udhcpc reported to its script.
type dhcpLease map[string]string

// runUDHCPC runs busybox's DHCP client once on ifName inside ns; the script
// it calls records the lease and configures the address and default route
// like a guest's network setup would. ok is false when no lease came.
func runUDHCPC(t *testing.T, ns *cnitest.NS, ifName string, tries int) (dhcpLease, bool) {
	t.Helper()
	dir := t.TempDir()
	out := filepath.Join(dir, "lease.env")
	script := filepath.Join(dir, "udhcpc.sh")
	body := `#!/bin/sh
case "$1" in
bound|renew)
	env > ` + out + `
	/usr/sbin/ip addr flush dev "$interface"
	/usr/sbin/ip addr add "$ip/$mask" dev "$interface"
	/usr/sbin/ip route replace default via "$router" dev "$interface"
	;;
esac
`
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := ns.Run(ctx, "busybox", "udhcpc", "-i", ifName, "-f", "-n", "-q",
		"-t", fmt.Sprint(tries), "-T", "1", "-A", "1", "-s", script)
	if err != nil {
		return nil, false
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("udhcpc succeeded but its script recorded nothing: %v", err)
	}
	lease := dhcpLease{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			lease[k] = v
		}
	}
	return lease, true
}

// listenIn opens a TCP listener inside ns (the socket stays there).
func listenIn(t *testing.T, ns *cnitest.NS, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	err := ns.Do(func() error {
		var err error
		l, err = net.Listen("tcp4", addr)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// dialIn connects from inside ns.
func dialIn(ns *cnitest.NS, addr string) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout("tcp4", addr, 5*time.Second)
		return err
	})
	return c, err
}

// peerOf connects from ns to l's address and returns the source address l
// saw, after checking the connection carries data both ways.
func peerOf(t *testing.T, ns *cnitest.NS, l net.Listener, addr string) net.IP {
	t.Helper()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := dialIn(ns, addr)
	if err != nil {
		out, _ := exec.Command("nft", "list", "ruleset").CombinedOutput()
		t.Logf("%s", out)
		t.Fatalf("connect to %s: %v", addr, err)
	}
	defer c.Close()
	var s net.Conn
	select {
	case s = <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s accepted nothing", addr)
	}
	if s == nil {
		t.Fatalf("accept on %s failed", addr)
	}
	defer s.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	_ = s.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := s.Read(buf); err != nil || string(buf) != "ping" {
		t.Fatalf("server read %q, %v", buf, err)
	}
	if _, err := s.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(buf); err != nil || string(buf) != "pong" {
		t.Fatalf("client read %q, %v", buf, err)
	}
	return s.RemoteAddr().(*net.TCPAddr).IP.To4()
}

func readSysctl(t *testing.T, key string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc/sys", key))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// nftList prints the table of family of the pod network on bridge
// testBridge, "" when it is missing.
func nftList(t *testing.T, family string) string {
	t.Helper()
	out, err := exec.Command("nft", "list", "table", family, podnet.TableName(testBridge)).CombinedOutput()
	if err != nil {
		if strings.Contains(string(out), "No such file") {
			return ""
		}
		t.Fatalf("nft list table: %v: %s", err, out)
	}
	return string(out)
}

// dropped is the packet counter of the rule containing match.
func dropped(rules, match string) int {
	for _, line := range strings.Split(rules, "\n") {
		if !strings.Contains(line, match) {
			continue
		}
		f := strings.Fields(line)
		for i := range f[:len(f)-1] {
			if f[i] == "packets" {
				v, _ := strconv.Atoi(f[i+1])
				return v
			}
		}
	}
	return 0
}

// setNeigh pins a neighbour entry on the node's side of the bridge.
func setNeigh(t *testing.T, ip, mac string) {
	t.Helper()
	out, err := exec.Command("ip", "neigh", "replace", ip, "lladdr", mac, "dev", "pntest0", "nud", "permanent").CombinedOutput()
	if err != nil {
		t.Fatalf("ip neigh: %v %s", err, out)
	}
}

func linkExists(name string) bool {
	_, err := netlink.LinkByName(name)
	return err == nil
}
