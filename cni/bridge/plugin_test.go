package bridge_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/cni/cnitest"
)

func TestVerbsAcrossVersions(t *testing.T) {
	ctx := context.Background()
	for _, v := range []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
		t.Run(v, func(t *testing.T) {
			e := newEnv(t)
			c := e.container()
			conf := e.conf(v, "10.10.0.0/24", map[string]any{"macspoofchk": true})
			res, err := e.rt.Add(ctx, conf, att("ctr1", c))
			if err != nil {
				t.Fatalf("ADD: %v", err)
			}
			if res.Version() != v {
				t.Fatalf("result version %s, want %s", res.Version(), v)
			}
			cur, err := current.NewResultFromResult(res)
			if err != nil {
				t.Fatal(err)
			}
			if len(cur.IPs) != 1 || !strings.HasPrefix(cur.IPs[0].Address.String(), "10.10.0.") {
				t.Fatalf("IPs = %v", cur.IPs)
			}
			if len(cur.Interfaces) != 3 || cur.Interfaces[0].Name != "br0" || cur.Interfaces[2].Sandbox != c.Path {
				t.Fatalf("interfaces = %+v", cur.Interfaces)
			}
			var addrOK bool
			_ = c.Do(func() error {
				l, err := netlink.LinkByName("eth0")
				if err != nil {
					return err
				}
				as, _ := netlink.AddrList(l, netlink.FAMILY_V4)
				addrOK = len(as) == 1 && as[0].IPNet.String() == cur.IPs[0].Address.String()
				return nil
			})
			if !addrOK {
				t.Fatal("container eth0 lacks the IPAM address")
			}
			if len(e.ports("br0")) != 1 {
				t.Fatalf("ports on br0: %v", e.ports("br0"))
			}
			if v != "0.3.1" {
				if err := e.rt.Check(ctx, conf, att("ctr1", c)); err != nil {
					t.Fatalf("CHECK: %v", err)
				}
			}
			if v == "1.1.0" {
				if err := e.rt.Status(ctx, conf); err != nil {
					t.Fatalf("STATUS: %v", err)
				}
			}
			if err := e.rt.Del(ctx, conf, att("ctr1", c)); err != nil {
				t.Fatalf("DEL: %v", err)
			}
			if p := e.ports("br0"); len(p) != 0 {
				t.Fatalf("ports left after DEL: %v", p)
			}
			if s := e.stateFiles(); len(s) != 0 {
				t.Fatalf("state left after DEL: %v", s)
			}
			if r := e.reservations(); len(r) != 0 {
				t.Fatalf("IPAM reservations left after DEL: %v", r)
			}
			if strings.Contains(e.ruleset(), "spoof_") {
				t.Fatalf("spoof chain left after DEL:\n%s", e.ruleset())
			}
			if err := e.rt.Del(ctx, conf, att("ctr1", c)); err != nil {
				t.Fatalf("second DEL must succeed: %v", err)
			}
		})
	}
}

func TestVersionVerb(t *testing.T) {
	e := newEnv(t)
	info, err := e.rt.CNI.GetVersionInfo(context.Background(), "cnv-bridge")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
		if !slices.Contains(info.SupportedVersions(), v) {
			t.Errorf("VERSION lacks %s: %v", v, info.SupportedVersions())
		}
	}
}

func TestBadConfigs(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	c := e.container()
	cases := []struct {
		name  string
		extra map[string]any
		code  uint
		field string
	}{
		{"vlan range", map[string]any{"vlan": 5000}, types.ErrInvalidNetworkConfig, `"vlan"`},
		{"mtu", map[string]any{"mtu": 10}, types.ErrInvalidNetworkConfig, `"mtu"`},
		{"bridge name", map[string]any{"bridge": "a-very-long-bridge-name"}, types.ErrInvalidNetworkConfig, `"bridge"`},
		{"hairpin+promisc", map[string]any{"hairpinMode": true, "promiscMode": true}, types.ErrInvalidNetworkConfig, `"hairpinMode"`},
		{"trunk range", map[string]any{"vlanTrunk": []map[string]int{{"minID": 300, "maxID": 200}}}, types.ErrInvalidNetworkConfig, `"vlanTrunk[0]"`},
		{"trunk empty", map[string]any{"vlanTrunk": []map[string]int{{}}}, types.ErrInvalidNetworkConfig, `"vlanTrunk[0]"`},
		{"mac", map[string]any{"args": map[string]any{"cni": map[string]any{"mac": "zz:00"}}}, types.ErrInvalidNetworkConfig, `"args.cni.mac"`},
		{"type of vlan", map[string]any{"vlan": "ten"}, types.ErrDecodingFailure, "vlan"},
		{"ipam plugin", map[string]any{"ipam": map[string]any{"type": "no-such-ipam"}}, types.ErrInvalidNetworkConfig, `"ipam.type"`},
		{"stateDir", map[string]any{"stateDir": "relative"}, types.ErrInvalidNetworkConfig, `"stateDir"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.rt.Add(ctx, e.conf("1.0.0", "", tc.extra), att("bad", c))
			ce := cniError(t, err)
			if ce.Code != tc.code || !strings.Contains(ce.Msg, tc.field) {
				t.Fatalf("got code %d %q, want code %d naming %s", ce.Code, ce.Msg, tc.code, tc.field)
			}
		})
	}
	if p := e.hostLinks(); len(p) > 2 {
		t.Fatalf("failed ADDs left links behind: %v", p)
	}
	if s := e.stateFiles(); len(s) != 0 {
		t.Fatalf("failed ADDs left state: %v", s)
	}
}

// TestVLANOnThisKernel checks a VLAN request against what the kernel can
// really do: on a kernel without bridge VLAN filtering it must fail with a
// clear error and attach nothing; with it, the port must carry the VLAN.
func TestVLANOnThisKernel(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	c := e.container()
	conf := e.conf("1.0.0", "", map[string]any{"vlan": 100})
	_, err := e.rt.Add(ctx, conf, att("vlan", c))
	if !vlanFilteringWorks(t) {
		ce := cniError(t, err)
		if ce.Code != types.ErrUnsupportedField || !strings.Contains(ce.Msg, "vlan=100") {
			t.Fatalf("got code %d %q, want code 2 naming vlan=100", ce.Code, ce.Msg)
		}
		if p := e.ports("br0"); len(p) != 0 {
			t.Fatalf("refused VLAN attachment left ports: %v", p)
		}
		// An administrator's existing bridge gets the same answer.
		_, err = e.rt.Add(ctx, e.conf("1.0.0", "", map[string]any{"vlanTrunk": []map[string]int{{"id": 7}}}), att("vlan2", c))
		if ce := cniError(t, err); ce.Code != types.ErrUnsupportedField {
			t.Fatalf("trunk: got %v", ce)
		}
		return
	}
	if err != nil {
		t.Fatalf("ADD with vlan on a filtering kernel: %v", err)
	}
	out, _ := e.host.Run(ctx, "bridge", "vlan", "show")
	if !strings.Contains(out, "100 PVID") {
		t.Fatalf("port lacks vlan 100:\n%s", out)
	}
}

func TestMACSources(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	cases := []struct {
		name    string
		extra   map[string]any
		cniArgs [][2]string
		caps    map[string]any
		want    string
	}{
		{"CNI_ARGS", nil, [][2]string{{"IgnoreUnknown", "1"}, {"MAC", "02:00:00:00:aa:01"}}, nil, "02:00:00:00:aa:01"},
		{"args", map[string]any{"args": map[string]any{"cni": map[string]any{"mac": "02:00:00:00:aa:02"}}}, nil, nil, "02:00:00:00:aa:02"},
		{"runtimeConfig wins", map[string]any{"capabilities": map[string]bool{"mac": true}},
			[][2]string{{"MAC", "02:00:00:00:aa:09"}}, map[string]any{"mac": "02:00:00:00:aa:03"}, "02:00:00:00:aa:03"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := e.container()
			conf := e.conf("1.0.0", "", tc.extra)
			rt := att(fmt.Sprintf("mac%d", i), c)
			rt.Args, rt.CapabilityArgs = tc.cniArgs, tc.caps
			res, err := e.rt.Add(ctx, conf, rt)
			if err != nil {
				t.Fatal(err)
			}
			cur, _ := current.NewResultFromResult(res)
			var got string
			_ = c.Do(func() error {
				l, err := netlink.LinkByName("eth0")
				if err == nil {
					got = l.Attrs().HardwareAddr.String()
				}
				return err
			})
			if got != tc.want || cur.Interfaces[2].Mac != tc.want {
				t.Fatalf("container MAC %s, result %s, want %s", got, cur.Interfaces[2].Mac, tc.want)
			}
			if err := e.rt.Del(ctx, conf, rt); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func ping(ctx context.Context, from *cnitest.NS, ip string) error {
	_, err := from.Run(ctx, "busybox", "ping", "-c", "1", "-W", "1", ip)
	return err
}

func firstIP(t *testing.T, r types.Result) string {
	t.Helper()
	cur, err := current.NewResultFromResult(r)
	if err != nil || len(cur.IPs) == 0 {
		t.Fatalf("result without IP: %v %v", r, err)
	}
	return cur.IPs[0].Address.IP.String()
}

func TestSpoofCheckDropsForgedMAC(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	c1, c2 := e.container(), e.container()
	conf := e.conf("1.0.0", "10.20.0.0/24", map[string]any{"macspoofchk": true})
	if _, err := e.rt.Add(ctx, conf, att("s1", c1)); err != nil {
		t.Fatal(err)
	}
	r2, err := e.rt.Add(ctx, conf, att("s2", c2))
	if err != nil {
		t.Fatal(err)
	}
	ip2 := firstIP(t, r2)
	if err := ping(ctx, c1, ip2); err != nil {
		t.Fatalf("ping with the real MAC must work: %v", err)
	}
	setMAC := func(mac string) {
		if _, err := c1.Run(ctx, "ip", "link", "set", "eth0", "address", mac); err != nil {
			t.Fatal(err)
		}
	}
	var real string
	_ = c1.Do(func() error {
		l, err := netlink.LinkByName("eth0")
		if err == nil {
			real = l.Attrs().HardwareAddr.String()
		}
		return err
	})
	setMAC("02:66:66:66:66:66")
	if err := ping(ctx, c1, ip2); err == nil {
		t.Fatal("ping from a forged source MAC got through")
	}
	setMAC(real)
	if err := ping(ctx, c1, ip2); err != nil {
		t.Fatalf("ping after restoring the MAC: %v", err)
	}
}

func TestDelAfterNetnsGone(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	c := e.container()
	conf := e.conf("1.0.0", "10.30.0.0/24", map[string]any{"macspoofchk": true})
	if _, err := e.rt.Add(ctx, conf, att("gone", c)); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(e.ruleset(), "spoof_") || len(e.stateFiles()) != 1 || len(e.reservations()) != 1 {
		t.Fatal("expected the spoof chain, state record and reservation to outlive the netns")
	}
	if err := e.rt.Del(ctx, conf, att("gone", c)); err != nil {
		t.Fatalf("DEL without netns: %v", err)
	}
	if strings.Contains(e.ruleset(), "spoof_") || strings.Contains(e.ruleset(), "jump") {
		t.Fatalf("rules left:\n%s", e.ruleset())
	}
	if len(e.ports("br0")) != 0 || len(e.stateFiles()) != 0 || strings.Contains(e.ruleset(), "jump") {
		t.Fatalf("left: ports %v state %v rules\n%s", e.ports("br0"), e.stateFiles(), e.ruleset())
	}
}

func TestGCRemovesStaleAttachments(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	keep, drop := e.container(), e.container()
	conf := e.conf("1.1.0", "10.40.0.0/24", map[string]any{"macspoofchk": true})
	if _, err := e.rt.Add(ctx, conf, att("keep", keep)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt.Add(ctx, conf, att("drop", drop)); err != nil {
		t.Fatal(err)
	}
	_ = drop.Close()
	// A runtime that lost its cache: only the plugin's GC can clean up.
	fresh := cnitest.NewRuntime(e.host, []string{pluginDir(t)}, t.TempDir())
	if err := fresh.GC(ctx, conf, []types.GCAttachment{{ContainerID: "keep", IfName: "eth0"}}); err != nil {
		t.Fatalf("GC: %v", err)
	}
	if n := strings.Count(e.ruleset(), "chain spoof_"); n != 1 {
		t.Fatalf("want exactly the kept spoof chain, found %d:\n%s", n, e.ruleset())
	}
	if len(e.stateFiles()) != 1 || len(e.reservations()) != 1 || len(e.ports("br0")) != 1 {
		t.Fatalf("after GC: state %v ipam %v ports %v", e.stateFiles(), e.reservations(), e.ports("br0"))
	}
	if err := e.rt.Check(ctx, conf, att("keep", keep)); err != nil {
		t.Fatalf("kept attachment broken by GC: %v", err)
	}
}

func TestCheckDetectsTampering(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	c := e.container()
	conf := e.conf("1.0.0", "10.50.0.0/24", map[string]any{"macspoofchk": true})
	res, err := e.rt.Add(ctx, conf, att("chk", c))
	if err != nil {
		t.Fatal(err)
	}
	cur, _ := current.NewResultFromResult(res)
	port := cur.Interfaces[1].Name
	ip := cur.IPs[0].Address.String()
	if err := e.rt.Check(ctx, conf, att("chk", c)); err != nil {
		t.Fatalf("CHECK of an intact attachment: %v", err)
	}
	tampers := []struct {
		name        string
		ns          *cnitest.NS
		do, undo    []string
		wantInError string
	}{
		{"port detached", e.host, []string{"ip", "link", "set", port, "nomaster"}, []string{"ip", "link", "set", port, "master", "br0"}, "not attached"},
		{"address removed", c, []string{"ip", "addr", "del", ip, "dev", "eth0"}, []string{"ip", "addr", "add", ip, "dev", "eth0"}, "lacks address"},
		{"spoof jump removed", e.host, []string{"nft", "flush", "map", "bridge", "nodevirt_bridge", "ports"}, nil, "macspoofchk"},
		{"MAC changed", c, []string{"ip", "link", "set", "eth0", "address", "02:12:34:56:78:9a"}, nil, "MAC"},
	}
	for _, tc := range tampers {
		if _, err := tc.ns.Run(ctx, tc.do[0], tc.do[1:]...); err != nil {
			t.Fatal(err)
		}
		err := e.rt.Check(ctx, conf, att("chk", c))
		if err == nil || !strings.Contains(err.Error(), tc.wantInError) {
			t.Fatalf("%s: CHECK said %v, want an error containing %q", tc.name, err, tc.wantInError)
		}
		if tc.undo != nil {
			if _, err := tc.ns.Run(ctx, tc.undo[0], tc.undo[1:]...); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Start over for the last tamper: the spoof chain itself emptied.
	if err := e.rt.Del(ctx, conf, att("chk", c)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt.Add(ctx, conf, att("chk", c)); err != nil {
		t.Fatal(err)
	}
	if err := e.rt.Check(ctx, conf, att("chk", c)); err != nil {
		t.Fatalf("CHECK after re-ADD: %v", err)
	}
	if _, err := e.host.Run(ctx, "nft", "flush", "chain", "bridge", "nodevirt_bridge", spoofChainOf(t, e)); err != nil {
		t.Fatal(err)
	}
	if err := e.rt.Check(ctx, conf, att("chk", c)); err == nil || !strings.Contains(err.Error(), "macspoofchk") {
		t.Fatalf("CHECK with flushed spoof rules said %v", err)
	}
}

func spoofChainOf(t *testing.T, e *env) string {
	for _, line := range strings.Split(e.ruleset(), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "chain" && strings.HasPrefix(f[1], "spoof_") {
			return f[1]
		}
	}
	t.Fatal("no spoof chain")
	return ""
}

func TestConcurrentAdds(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	conf := e.conf("1.0.0", "10.60.0.0/24", map[string]any{"macspoofchk": true})
	const n = 16
	ctrs := make([]*cnitest.NS, n)
	for i := range ctrs {
		ctrs[i] = e.container()
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	ips := make([]string, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := e.rt.Add(ctx, conf, att(fmt.Sprintf("cc%d", i), ctrs[i]))
			errs[i] = err
			if err == nil {
				cur, _ := current.NewResultFromResult(r)
				ips[i] = cur.IPs[0].Address.IP.String()
			}
		}()
	}
	wg.Wait()
	seen := map[string]bool{}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("ADD %d: %v", i, err)
		}
		if seen[ips[i]] {
			t.Fatalf("duplicate IP %s", ips[i])
		}
		seen[ips[i]] = true
	}
	if p := e.ports("br0"); len(p) != n {
		t.Fatalf("%d ports, want %d", len(p), n)
	}
	if c := strings.Count(e.ruleset(), "chain spoof_"); c != n {
		t.Fatalf("%d spoof chains, want %d", c, n)
	}
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = e.rt.Del(ctx, conf, att(fmt.Sprintf("cc%d", i), ctrs[i]))
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("DEL %d: %v", i, err)
		}
	}
	if p := e.ports("br0"); len(p) != 0 {
		t.Fatalf("ports left: %v", p)
	}
}

// TestAddAgainReplacesStalePort: an ADD repeated without DEL (a runtime
// retrying after a lost answer) replaces its own port, while an ADD whose
// interface name the container already uses is refused and leaves nothing.
func TestAddAgainReplacesStalePort(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	c := e.container()
	// No IPAM: host-local itself refuses a second allocation to one owner.
	conf := e.conf("1.0.0", "", map[string]any{"macspoofchk": true})
	for range 2 {
		if _, err := e.rt.Add(ctx, conf, att("again", c)); err != nil {
			t.Fatal(err)
		}
	}
	if p := e.ports("br0"); len(p) != 1 {
		t.Fatalf("ports after ADD twice: %v", p)
	}
	other := e.conf("1.0.0", "", map[string]any{"name": "othernet", "bridge": "br1"})
	_, err := e.rt.Add(ctx, other, att("again", c))
	if err == nil || !strings.Contains(err.Error(), "already exists in the container netns") {
		t.Fatalf("ADD of a taken eth0 said %v", err)
	}
	if p := e.ports("br1"); len(p) != 0 {
		t.Fatalf("refused ADD left ports: %v", p)
	}
	if err := e.rt.Del(ctx, conf, att("again", c)); err != nil {
		t.Fatal(err)
	}
	if len(e.ports("br0")) != 0 || len(e.stateFiles()) != 0 || strings.Contains(e.ruleset(), "jump") {
		t.Fatalf("left: ports %v state %v rules\n%s", e.ports("br0"), e.stateFiles(), e.ruleset())
	}
}
