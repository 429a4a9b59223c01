package bridge

import (
	"context"
	"net"
	"strings"
	"testing"

	"github.com/nodevirt/nodevirt/cni/cnitest"
)

// nftNS is a throwaway namespace with helpers to run the netlink rule code
// in it and read back what nft(8) lists.
type nftNS struct {
	t  *testing.T
	ns *cnitest.NS
}

func newNFTNS(t *testing.T) *nftNS {
	t.Helper()
	ns, err := cnitest.NewNS("nvtbl")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ns.Close() })
	return &nftNS{t: t, ns: ns}
}

func (n *nftNS) do(fn func() error) {
	n.t.Helper()
	if err := n.ns.Do(fn); err != nil {
		n.t.Fatal(err)
	}
}

func (n *nftNS) list(args ...string) string {
	n.t.Helper()
	out, err := n.ns.Run(context.Background(), "nft", append([]string{"list"}, args...)...)
	if err != nil {
		n.t.Fatal(err)
	}
	return out
}

// TestSpoofRulesAsNFTListsThem pins the rules' meaning to nft's own
// rendering of them (the rules the nft-script version of this code made),
// and checks that adding is idempotent and removal of what is gone succeeds.
func TestSpoofRulesAsNFTListsThem(t *testing.T) {
	n := newNFTNS(t)
	mac, _ := net.ParseMAC("02:00:00:00:00:01")
	for range 2 {
		n.do(func() error { return addSpoofRules("nvtap0", mac, "tap/nvtap0") })
	}
	c := spoofChainName("nvtap0")
	out := n.list("table", "bridge", spoofTable)
	for _, want := range []string{
		"type ifname : verdict",
		`elements = { "nvtap0" : jump ` + c + " }",
		"type filter hook prerouting priority dstnat; policy accept;",
		"iifname vmap @ports",
		"chain " + c + " {",
		`ether saddr != 02:00:00:00:00:01 drop comment "tap/nvtap0"`,
		`arp saddr ether != 02:00:00:00:00:01 drop comment "tap/nvtap0"`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("nft lists no %q in:\n%s", want, out)
		}
	}
	if k := strings.Count(out, "drop comment"); k != 2 {
		t.Errorf("%d rules after adding twice, want 2:\n%s", k, out)
	}
	if k := strings.Count(out, "iifname vmap"); k != 1 {
		t.Errorf("%d base rules after adding twice, want 1:\n%s", k, out)
	}
	n.do(func() error { return checkSpoofRules("nvtap0", mac) })
	other, _ := net.ParseMAC("02:00:00:00:00:02")
	if err := n.ns.Do(func() error { return checkSpoofRules("nvtap0", other) }); err == nil {
		t.Error("check accepted rules pinning another MAC")
	}
	for range 2 {
		n.do(func() error { return delSpoofRules("nvtap0") })
	}
	n.do(func() error { return delSpoofRules("nvneveradded") })
	if out := n.list("table", "bridge", spoofTable); strings.Contains(out, "spoof_") || strings.Contains(out, "jump") {
		t.Fatalf("rules left after removal:\n%s", out)
	}
	if err := n.ns.Do(func() error { return checkSpoofRules("nvtap0", mac) }); err == nil {
		t.Error("check accepted removed rules")
	}
}

func TestMasqRulesAsNFTListsThem(t *testing.T) {
	n := newNFTNS(t)
	_, v4, _ := net.ParseCIDR("10.1.0.0/24")
	v4.IP = net.ParseIP("10.1.0.5").To4()
	_, v6, _ := net.ParseCIDR("fd00::/64")
	v6.IP = net.ParseIP("fd00::5")
	_, odd, _ := net.ParseCIDR("10.2.0.0/20")
	odd.IP = net.ParseIP("10.2.3.4").To4()
	addrs := []*net.IPNet{v4, v6, odd}
	n.do(func() error { return addMasqRules("net/ctr/eth0", addrs) })
	c := masqChainName("net/ctr/eth0")
	out := n.list("table", "inet", natTable)
	for _, want := range []string{
		"type nat hook postrouting priority srcnat; policy accept;",
		"ip saddr vmap @masq4",
		"ip6 saddr vmap @masq6",
		`ip daddr != 10.1.0.0/24 ip daddr != 224.0.0.0/4 masquerade comment "net/ctr/eth0"`,
		`ip6 daddr != fd00::/64 ip6 daddr != ff00::/8 masquerade comment "net/ctr/eth0"`,
		`ip daddr != 10.2.0.0/20 ip daddr != 224.0.0.0/4 masquerade comment "net/ctr/eth0"`,
		"10.1.0.5 : jump " + c,
		"10.2.3.4 : jump " + c,
		"fd00::5 : jump " + c,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("nft lists no %q in:\n%s", want, out)
		}
	}
	ips := []net.IP{v4.IP, v6.IP, odd.IP}
	for range 2 {
		n.do(func() error { return delMasqRules("net/ctr/eth0", ips) })
	}
	if out := n.list("table", "inet", natTable); strings.Contains(out, "masq_") || strings.Contains(out, "jump") {
		t.Fatalf("rules left after removal:\n%s", out)
	}
}

func TestRemoveUnusedTablesKeepsUsedOnes(t *testing.T) {
	n := newNFTNS(t)
	ctx := context.Background()
	mac, _ := net.ParseMAC("02:00:00:00:00:01")
	n.do(func() error {
		if err := addSpoofRules("nvtap0", mac, "tap/nvtap0"); err != nil {
			return err
		}
		return RemoveUnusedTables(ctx)
	})
	if !strings.Contains(n.list("tables"), spoofTable) {
		t.Fatal("a table with a port in use was removed")
	}
	n.do(func() error {
		if err := delSpoofRules("nvtap0"); err != nil {
			return err
		}
		if err := delMasqRules("a/b/c", nil); err != nil {
			return err
		}
		return RemoveUnusedTables(ctx)
	})
	if out := n.list("tables"); strings.Contains(out, spoofTable) || strings.Contains(out, natTable) {
		t.Fatalf("unused table left:\n%s", out)
	}
	n.do(func() error { return RemoveUnusedTables(ctx) })
}
