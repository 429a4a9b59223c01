package bridgemarker_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nodevirt/nodevirt/cni/cnitest"
	"github.com/nodevirt/nodevirt/nodeagent/bridgemarker"
)

// recorder keeps every set the Marker publishes.
type recorder struct{ ch chan map[string]int64 }

func (r *recorder) Publish(_ context.Context, res map[string]int64) error {
	r.ch <- maps.Clone(res)
	return nil
}

// waitFor returns how long it took until a published set satisfies ok.
func waitFor(t *testing.T, r *recorder, what string, ok func(map[string]int64) bool) time.Duration {
	t.Helper()
	start := time.Now()
	deadline := time.After(time.Second)
	for {
		select {
		case got := <-r.ch:
			if ok(got) {
				return time.Since(start)
			}
		case <-deadline:
			t.Fatalf("within 1s, no publish with %s", what)
		}
	}
}

func startMarker(t *testing.T, ns *cnitest.NS, requireUplink bool) *recorder {
	t.Helper()
	h, err := netns.GetFromPath(ns.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	r := &recorder{ch: make(chan map[string]int64, 64)}
	m, err := bridgemarker.New(bridgemarker.Config{Publisher: r, RequireUplink: requireUplink, NetNS: &h})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return r
}

func TestMarkerFollowsBridges(t *testing.T) {
	ns, err := cnitest.NewNS("nvbm")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	nh, _ := netns.GetFromPath(ns.Path)
	defer nh.Close()
	h, err := netlink.NewHandleAt(nh, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()

	all := startMarker(t, ns, false)
	uplinked := startMarker(t, ns, true)
	waitFor(t, all, "the initial empty set", func(m map[string]int64) bool { return len(m) == 0 })

	const key = bridgemarker.ResourcePrefix + "brm0"
	if err := h.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "brm0"}}); err != nil {
		t.Fatal(err)
	}
	d := waitFor(t, all, "brm0 at 1024 free ports", func(m map[string]int64) bool { return m[key] == 1024 })
	t.Logf("bridge published %v after creation", d)

	br, _ := h.LinkByName("brm0")
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "vm0", MasterIndex: br.Attrs().Index}, PeerName: "vm0p"}
	if err := h.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	waitFor(t, all, "brm0 at 1023 after a veth port", func(m map[string]int64) bool { return m[key] == 1023 })

	// Only veth ports: not an uplinked bridge yet.
	select {
	case m := <-uplinked.ch:
		if _, ok := m[key]; ok {
			t.Fatalf("RequireUplink published a bridge without uplink: %v", m)
		}
	case <-time.After(100 * time.Millisecond):
	}
	// An uplink: a VXLAN device (this kernel has no dummy driver).
	if err := h.LinkAdd(&netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: "up0", MasterIndex: br.Attrs().Index}, VxlanId: 42, Port: 4789}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, uplinked, "brm0 once it has an uplink", func(m map[string]int64) bool { return m[key] == 1022 })

	if err := h.LinkDel(br); err != nil {
		t.Fatal(err)
	}
	waitFor(t, all, "brm0 removed", func(m map[string]int64) bool { _, ok := m[key]; return !ok })
}

func TestCompute(t *testing.T) {
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "b", Index: 5}}
	links := []netlink.Link{br,
		&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "v", Index: 6, MasterIndex: 5}},
		&netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: "t", Index: 7, MasterIndex: 5}},
	}
	if got := bridgemarker.Compute(links, false); got[bridgemarker.ResourcePrefix+"b"] != 1022 {
		t.Fatalf("Compute = %v", got)
	}
	if got := bridgemarker.Compute(links, true); len(got) != 0 {
		t.Fatalf("no uplink, yet Compute = %v", got)
	}
}
