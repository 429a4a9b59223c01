package podnet

import (
	"bytes"
	"encoding/binary"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testNetwork is a Network whose allocations are made directly, without
// taps, for the DHCP decisions.
func testNetwork(t *testing.T) *Network {
	t.Helper()
	n, err := New(Config{
		Bridge: "unused0", CIDR: "10.244.0.0/24", StateDir: t.TempDir(),
		ResolvConf: filepath.Join(t.TempDir(), "missing"), LeaseTime: time.Hour,
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func request(typ byte, mac net.HardwareAddr, opts ...dhcpOption) *dhcpMsg {
	return &dhcpMsg{
		Op: bootRequest, XID: 0x1234abcd, CIAddr: net.IPv4zero.To4(), GIAddr: net.IPv4zero.To4(), CHAddr: mac,
		Options: append([]dhcpOption{{optMessageType, []byte{typ}}}, opts...),
	}
}

func TestDHCPRoundTrip(t *testing.T) {
	long := bytes.Repeat([]byte{'x'}, 300)
	m := &dhcpMsg{
		Op: bootReply, XID: 42, Flags: flagBroadcast,
		CIAddr: net.ParseIP("10.0.0.1").To4(), YIAddr: net.ParseIP("10.0.0.2").To4(),
		SIAddr: net.ParseIP("10.0.0.3").To4(), GIAddr: net.ParseIP("10.0.0.4").To4(),
		CHAddr:  net.HardwareAddr{2, 0, 0, 0, 0, 9},
		Options: []dhcpOption{{optMessageType, []byte{dhcpAck}}, {optDomainSearch, long}},
	}
	b := m.marshal()
	if len(b) < bootpMinLen {
		t.Fatalf("message of %d bytes, below the BOOTP minimum", len(b))
	}
	got, err := parseDHCP(b)
	if err != nil {
		t.Fatal(err)
	}
	if got.XID != 42 || got.Flags != flagBroadcast || !got.YIAddr.Equal(m.YIAddr) || !got.GIAddr.Equal(m.GIAddr) ||
		!got.CIAddr.Equal(m.CIAddr) || !got.SIAddr.Equal(m.SIAddr) || got.CHAddr.String() != m.CHAddr.String() {
		t.Fatalf("round trip changed the header: %+v", got)
	}
	if got.msgType() != dhcpAck || !bytes.Equal(got.option(optDomainSearch), long) {
		t.Fatal("options lost in the round trip (a 300-byte option must be split and joined)")
	}
	for _, bad := range [][]byte{b[:100], append(append([]byte{}, b[:240]...), optHostname, 40, 'a')} {
		if _, err := parseDHCP(bad); err == nil {
			t.Errorf("parsed a broken message of %d bytes", len(bad))
		}
	}
}

func TestEncodeDomainSearch(t *testing.T) {
	got := encodeDomainSearch([]string{"example.test.", "a..b", "x"})
	want := []byte("\x07example\x04test\x00\x01x\x00")
	if !bytes.Equal(got, want) {
		t.Fatalf("encoded %q, want %q", got, want)
	}
}

func TestDHCPReplies(t *testing.T) {
	n := testNetwork(t)
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 1}
	ip, err := n.allocs.assign("ns/web-1", "tap1", mac)
	if err != nil {
		t.Fatal(err)
	}
	gw := net.ParseIP("10.244.0.1").To4()

	// DISCOVER → OFFER, broadcast, with everything a guest needs.
	resp, dst := n.reply(request(dhcpDiscover, mac), 1450)
	if resp == nil || resp.msgType() != dhcpOffer || !resp.YIAddr.Equal(ip) || !dst.Equal(net.IPv4bcast) {
		t.Fatalf("discover → %+v to %v", resp, dst)
	}
	checks := map[byte][]byte{
		optServerID:   gw,
		optRouter:     gw,
		optSubnetMask: {255, 255, 255, 0},
		optBroadcast:  {10, 244, 0, 255},
		optDNS:        gw, // no usable resolv.conf: the gateway
		optMTU:        binary.BigEndian.AppendUint16(nil, 1450),
		optHostname:   []byte("web-1"),
		optLeaseTime:  binary.BigEndian.AppendUint32(nil, 3600),
		optRenewalT1:  binary.BigEndian.AppendUint32(nil, 1800),
	}
	for code, want := range checks {
		if got := resp.option(code); !bytes.Equal(got, want) {
			t.Errorf("offer option %d = %v, want %v", code, got, want)
		}
	}
	if resp.XID != 0x1234abcd || resp.Op != bootReply {
		t.Error("offer does not answer the request")
	}

	// REQUEST for the offered address → ACK; for another → NAK.
	resp, _ = n.reply(request(dhcpRequest, mac, dhcpOption{optRequestedIP, ip}, dhcpOption{optServerID, gw}), 1500)
	if resp == nil || resp.msgType() != dhcpAck || !resp.YIAddr.Equal(ip) {
		t.Fatalf("request → %+v", resp)
	}
	resp, dst = n.reply(request(dhcpRequest, mac, dhcpOption{optRequestedIP, net.ParseIP("10.244.0.250").To4()}), 1500)
	if resp == nil || resp.msgType() != dhcpNak || !dst.Equal(net.IPv4bcast) || resp.YIAddr != nil {
		t.Fatalf("request for a foreign address → %+v", resp)
	}
	// A client that chose another server gets nothing from us.
	if resp, _ := n.reply(request(dhcpRequest, mac, dhcpOption{optRequestedIP, ip}, dhcpOption{optServerID, net.ParseIP("10.244.0.77").To4()}), 1500); resp != nil {
		t.Fatalf("answered a request meant for another server: %+v", resp)
	}
	// Renewing: ciaddr set, unicast back to it.
	renew := request(dhcpRequest, mac)
	renew.CIAddr = ip
	resp, dst = n.reply(renew, 1500)
	if resp == nil || resp.msgType() != dhcpAck || !dst.Equal(ip) || !resp.CIAddr.Equal(ip) {
		t.Fatalf("renew → %+v to %v", resp, dst)
	}
	// INFORM: configuration, no address, no lease.
	inform := request(dhcpInform, mac)
	inform.CIAddr = ip
	resp, dst = n.reply(inform, 1500)
	if resp == nil || resp.msgType() != dhcpAck || resp.YIAddr != nil || resp.option(optLeaseTime) != nil || !dst.Equal(ip) {
		t.Fatalf("inform → %+v to %v", resp, dst)
	}
	// A MAC never attached, a BOOTREPLY, a RELEASE: silence.
	if resp, _ := n.reply(request(dhcpDiscover, net.HardwareAddr{2, 0, 0, 0, 0, 2}), 1500); resp != nil {
		t.Fatal("offered an address to a MAC never attached")
	}
	notReq := request(dhcpDiscover, mac)
	notReq.Op = bootReply
	if resp, _ := n.reply(notReq, 1500); resp != nil {
		t.Fatal("answered a BOOTREPLY")
	}
	if resp, _ := n.reply(request(dhcpRelease, mac), 1500); resp != nil {
		t.Fatal("answered a RELEASE")
	}
	if n.Lease(mac) == nil {
		t.Fatal("a RELEASE dropped the VMI's allocation")
	}
}

func TestReadResolvConf(t *testing.T) {
	p := filepath.Join(t.TempDir(), "resolv.conf")
	writeFile(t, p, "nameserver 127.0.0.53\nnameserver ::1\n# nameserver 9.9.9.9\nnameserver 192.0.2.1\nsearch a.example b.example\n")
	servers, search, err := readResolvConf(p)
	if err != nil {
		t.Fatal(err)
	}
	if len(servers) != 1 || !servers[0].Equal(net.ParseIP("192.0.2.1")) || strings.Join(search, ",") != "a.example,b.example" {
		t.Fatalf("servers %v search %v", servers, search)
	}
}

func TestHostnameOf(t *testing.T) {
	for key, want := range map[string]string{
		"ns/vm-1": "vm-1", "ns/vm-1/uid": "vm-1", "bare": "bare", "ns/under_score": "", "ns/-x": "", "": "",
	} {
		if got := hostnameOf(key); got != want {
			t.Errorf("hostnameOf(%q) = %q, want %q", key, got, want)
		}
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
