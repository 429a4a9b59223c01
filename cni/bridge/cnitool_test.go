package bridge_test

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/cni/cnitest"
)

var cnitool = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "cnitool-")
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	return cnitest.BuildCNITool(ctx, dir)
})

// containerLink returns eth0 of c.
func containerLink(t *testing.T, c *cnitest.NS) netlink.Link {
	t.Helper()
	var l netlink.Link
	err := c.Do(func() error {
		var err error
		l, err = netlink.LinkByName("eth0")
		return err
	})
	if err != nil {
		t.Fatalf("eth0 in %s: %v", c.Name, err)
	}
	return l
}

// TestCNIToolAttachesUpInterfaces drives the plugin binary with upstream
// cnitool, as a user would: after ADD the container's eth0 is up (with and
// without IPAM) and two containers on the bridge reach each other; CHECK
// passes; DEL leaves no port, record, reservation or libcni cache entry.
func TestCNIToolAttachesUpInterfaces(t *testing.T) {
	tool, err := cnitool()
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		subnet  string // "" = no IPAM: addresses are set by hand
		disable bool   // disableContainerInterface
	}{
		{name: "no ipam", subnet: ""},
		{name: "host-local", subnet: "10.80.0.0/24"},
		{name: "disableContainerInterface", disable: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t)
			c1, c2 := e.container(), e.container()
			extra := map[string]any{"macspoofchk": true}
			if tc.disable {
				extra["disableContainerInterface"] = true
			}
			confDir := t.TempDir()
			if err := os.WriteFile(filepath.Join(confDir, "testnet.conf"), e.conf("1.0.0", tc.subnet, extra), 0o644); err != nil {
				t.Fatal(err)
			}
			run := func(verb string, c *cnitest.NS) string {
				t.Helper()
				out, err := cnitest.CNITool(ctx, e.host, tool, confDir, pluginDir(t), verb, "testnet", c)
				if err != nil {
					t.Fatal(err)
				}
				return out
			}
			// cnitool keeps its result cache on the host (/var/lib/cni): a
			// test that stops half-way still deletes what it added.
			t.Cleanup(func() {
				for _, c := range []*cnitest.NS{c1, c2} {
					_, _ = cnitest.CNITool(ctx, e.host, tool, confDir, pluginDir(t), "del", "testnet", c)
				}
			})
			ips := map[*cnitest.NS]string{c1: "10.81.0.1", c2: "10.81.0.2"}
			for _, c := range []*cnitest.NS{c1, c2} {
				out := run("add", c)
				l := containerLink(t, c)
				up := l.Attrs().Flags&net.FlagUp != 0
				if up == tc.disable {
					t.Fatalf("after ADD eth0 of %s has flags %v (disableContainerInterface=%v)", c.Name, l.Attrs().Flags, tc.disable)
				}
				if tc.subnet != "" {
					var res struct {
						IPs []struct{ Address string } `json:"ips"`
					}
					if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.IPs) != 1 {
						t.Fatalf("cnitool add printed %q (%v)", out, err)
					}
					ips[c] = strings.Split(res.IPs[0].Address, "/")[0]
					continue
				}
				// Only an address by hand: the link must already be up.
				err := c.Do(func() error {
					a, err := netlink.ParseAddr(ips[c] + "/24")
					if err != nil {
						return err
					}
					return netlink.AddrAdd(l, a)
				})
				if err != nil {
					t.Fatal(err)
				}
			}
			if tc.disable {
				if err := ping(ctx, c1, ips[c2]); err == nil {
					t.Fatal("ping through an interface left down got through")
				}
			} else {
				if err := ping(ctx, c1, ips[c2]); err != nil {
					t.Fatalf("c1 -> c2 (%s): %v", ips[c2], err)
				}
				if err := ping(ctx, c2, ips[c1]); err != nil {
					t.Fatalf("c2 -> c1 (%s): %v", ips[c1], err)
				}
				run("check", c1)
			}
			for _, c := range []*cnitest.NS{c1, c2} {
				run("del", c)
				run("del", c) // DEL of what is gone succeeds
			}
			if p := e.ports("br0"); len(p) != 0 {
				t.Fatalf("ports left: %v", p)
			}
			if s := e.stateFiles(); len(s) != 0 {
				t.Fatalf("state left: %v", s)
			}
			if r := e.reservations(); len(r) != 0 {
				t.Fatalf("IPAM reservations left: %v", r)
			}
			if rs := e.ruleset(); strings.Contains(rs, "spoof_") || strings.Contains(rs, "jump") {
				t.Fatalf("nft rules left:\n%s", rs)
			}
			for _, c := range []*cnitest.NS{c1, c2} {
				if out, _ := c.Run(ctx, "ip", "-o", "link"); strings.Contains(out, "eth0") {
					t.Fatalf("eth0 left in %s:\n%s", c.Name, out)
				}
			}
		})
	}
}
