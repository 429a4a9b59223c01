package reach

import (
	"net/netip"
	"testing"
)

func TestReachPolicy(t *testing.T) {
	own := netip.MustParseAddr("192.0.2.7")
	p := &policy{ownAddrs: func() []netip.Addr { return []netip.Addr{own} }}
	for _, c := range []struct {
		ip string
		ok bool
	}{
		{"127.0.0.1", false}, {"127.1.2.3", false}, {"::1", false}, {"::ffff:127.0.0.1", false},
		{"0.0.0.0", false}, {"::", false},
		{"169.254.169.254", false}, {"fe80::1", false}, {"fd00:ec2::254", false}, {"100.100.100.200", false},
		{"168.63.129.16", false}, {"224.0.0.1", false},
		{"192.0.2.7", false}, {"::ffff:192.0.2.7", false},
		{"192.0.2.8", true}, {"10.1.2.3", true}, {"8.8.8.8", true}, {"2001:db8::1", true},
	} {
		err := p.check(netip.MustParseAddr(c.ip))
		if (err == nil) != c.ok {
			t.Errorf("%s: %v, want allowed=%v", c.ip, err, c.ok)
		}
		if err != nil && !IsNotAllowed(err) {
			t.Errorf("%s: %v is no *NotAllowedError", c.ip, err)
		}
	}
	allowed, err := ParseNetworks("127.0.0.0/8, 192.0.2.7 ,169.254.169.254/32")
	if err != nil {
		t.Fatal(err)
	}
	p.allowed = allowed
	for _, ip := range []string{"127.0.0.1", "::ffff:127.0.0.1", "192.0.2.7", "169.254.169.254"} {
		if err := p.check(netip.MustParseAddr(ip)); err != nil {
			t.Errorf("%s allowed explicitly: %v", ip, err)
		}
	}
	if err := p.check(netip.MustParseAddr("169.254.0.1")); err == nil {
		t.Errorf("169.254.0.1 allowed by a /32 exception")
	}
	if _, err := ParseNetworks("127.0.0.0/8,nonsense"); err == nil {
		t.Errorf("bad network accepted")
	}
}
