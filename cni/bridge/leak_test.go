package bridge_test

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestAddDelCyclesLeaveNothing runs ADD/DEL cycles through the binary and
// then looks for any link, nft rule, state record or IPAM reservation left.
func TestAddDelCyclesLeaveNothing(t *testing.T) {
	cycles := 1000
	if testing.Short() {
		cycles = 100
	}
	ctx := context.Background()
	e := newEnv(t)
	c := e.container()
	conf := e.conf("1.0.0", "10.70.0.0/24", map[string]any{"macspoofchk": true})
	start := time.Now()
	for i := range cycles {
		if _, err := e.rt.Add(ctx, conf, att("leak", c)); err != nil {
			t.Fatalf("cycle %d ADD: %v", i, err)
		}
		if err := e.rt.Del(ctx, conf, att("leak", c)); err != nil {
			t.Fatalf("cycle %d DEL: %v", i, err)
		}
	}
	t.Logf("%d ADD/DEL cycles in %v", cycles, time.Since(start))
	// DEL removes the link before it answers: nothing may linger.
	links := e.hostLinks()
	delete(links, "lo")
	delete(links, "br0")
	if len(links) != 0 {
		t.Fatalf("links left in host netns: %v", links)
	}
	if out, _ := c.Run(ctx, "ip", "-o", "link"); strings.Count(out, "\n") != 1 {
		t.Fatalf("links left in container netns:\n%s", out)
	}
	rs := e.ruleset()
	if strings.Contains(rs, "spoof_") || strings.Contains(rs, "jump") {
		t.Fatalf("nft rules left:\n%s", rs)
	}
	if out, _ := e.host.Run(ctx, "bridge", "vlan", "show"); strings.Contains(out, "nvb") {
		t.Fatalf("vlan entries left:\n%s", out)
	}
	if s := e.stateFiles(); len(s) != 0 {
		t.Fatalf("state left: %v", s)
	}
	if r := e.reservations(); len(r) != 0 {
		t.Fatalf("IPAM reservations left: %v", r)
	}
}
