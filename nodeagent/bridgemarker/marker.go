// Package bridgemarker publishes the node's Linux bridges as extended
// resources `bridge.network.kubevirt.io/<bridge>`, valued at the ports each
// bridge can still take. It reacts to netlink link events (a bridge that
// appears is published within milliseconds) instead of polling.
package bridgemarker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nodevirt/nodevirt/cni/bridge"
)

// ResourcePrefix prefixes every published resource name.
const ResourcePrefix = "bridge.network.kubevirt.io/"

// Publisher receives the full desired set of bridge resources each time it
// changes; a bridge missing from the map is to be removed. An error makes
// the Marker retry the same set later (with backoff) until it succeeds or a
// newer set replaces it.
type Publisher interface {
	Publish(ctx context.Context, resources map[string]int64) error
}

// Config configures a Marker.
type Config struct {
	// Publisher receives the resources (required).
	Publisher Publisher
	// RequireUplink publishes only bridges with at least one port that is
	// not a veth or tap (a NIC, bond, VLAN or tunnel device).
	RequireUplink bool
	// NetNS is the namespace to watch; the caller's when unset (tests set a
	// throwaway one).
	NetNS *netns.NsHandle
	// Log receives progress; slog.Default() when nil.
	Log *slog.Logger
}

// Marker watches bridges and publishes their free ports.
type Marker struct {
	cfg Config
}

// New validates cfg and returns a Marker.
func New(cfg Config) (*Marker, error) {
	if cfg.Publisher == nil {
		return nil, errors.New("bridgemarker: Publisher is required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Marker{cfg: cfg}, nil
}

const (
	retryMin = 200 * time.Millisecond
	retryMax = 30 * time.Second
)

// Run publishes the current bridges, then again after every link change,
// until ctx ends.
func (m *Marker) Run(ctx context.Context) error {
	ns := netns.None()
	if m.cfg.NetNS != nil {
		ns = *m.cfg.NetNS
	}
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("bridgemarker: netlink: %w", err)
	}
	defer h.Close()

	updates := make(chan netlink.LinkUpdate, 256)
	done := make(chan struct{})
	defer close(done)
	subErr := make(chan error, 1)
	opts := netlink.LinkSubscribeOptions{
		Namespace: &ns,
		ErrorCallback: func(err error) {
			select {
			case subErr <- err:
			default:
			}
		},
	}
	if err := netlink.LinkSubscribeWithOptions(updates, done, opts); err != nil {
		return fmt.Errorf("bridgemarker: subscribe to link updates: %w", err)
	}

	var published map[string]int64
	retry := time.NewTimer(0)
	<-retry.C
	backoff := retryMin
	pending := true // publish the initial state
	for {
		if pending {
			want, err := m.resources(h)
			if err != nil {
				return err
			}
			if published != nil && maps.Equal(want, published) {
				pending = false
			} else if err := m.cfg.Publisher.Publish(ctx, want); err != nil {
				m.cfg.Log.Warn("publish bridge resources", "error", err, "retryIn", backoff)
				retry.Reset(backoff)
				backoff = min(2*backoff, retryMax)
			} else {
				m.cfg.Log.Info("published bridge resources", "resources", want)
				published, pending, backoff = want, false, retryMin
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-subErr:
			return fmt.Errorf("bridgemarker: link subscription: %w", err)
		case _, ok := <-updates:
			if !ok {
				return errors.New("bridgemarker: link subscription closed")
			}
			drain(updates)
			pending = true
		case <-retry.C:
			pending = true
		}
	}
}

// drain discards queued updates: one re-listing answers them all.
func drain(ch <-chan netlink.LinkUpdate) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

// resources lists links and returns each (qualifying) bridge's free ports.
func (m *Marker) resources(h *netlink.Handle) (map[string]int64, error) {
	links, err := h.LinkList()
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return nil, fmt.Errorf("bridgemarker: list links: %w", err)
	}
	return Compute(links, m.cfg.RequireUplink), nil
}

// Compute maps each bridge among links to its free ports
// (bridge.MaxBridgePorts minus ports in use), keyed by resource name.
func Compute(links []netlink.Link, requireUplink bool) map[string]int64 {
	ports := map[int]int{}
	uplink := map[int]bool{}
	for _, l := range links {
		a := l.Attrs()
		if a.MasterIndex == 0 {
			continue
		}
		ports[a.MasterIndex]++
		if t := l.Type(); t != "veth" && t != "tuntap" {
			uplink[a.MasterIndex] = true
		}
	}
	out := map[string]int64{}
	for _, l := range links {
		if _, ok := l.(*netlink.Bridge); !ok {
			continue
		}
		idx := l.Attrs().Index
		if requireUplink && !uplink[idx] {
			continue
		}
		out[ResourcePrefix+l.Attrs().Name] = int64(max(bridge.MaxBridgePorts-ports[idx], 0))
	}
	return out
}
