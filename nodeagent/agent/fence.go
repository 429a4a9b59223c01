package agent

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/api/fencing"
	"github.com/nodevirt/nodevirt/nodeagent/handler"
)

// GuestStopper stops every guest of the node at once; the handler
// (handler.Handler.StopGuests) is one. Without one nothing is fenced.
type GuestStopper interface {
	StopGuests(ctx context.Context) (int, error)
}

// fencer is the self-fencing role (package fencing): when the Lease has not
// been renewed for longer than the window and no peer node agent answers
// either, this node is the one cut off, and the brain is about to start its
// VMIs elsewhere: it stops its guests. It fences once per outage.
//
// Peers are dialled all at once, each check; the node counts as cut off
// only when none has answered for confirm: one connect lost to a busy peer
// (seen in the Vagrant lab, node VMs under TCG on a loaded host) must not
// stop the guests. Window + confirm stays well inside the brain's margin.
type fencer struct {
	window  time.Duration
	renewed func() time.Time
	peers   func() []string
	guests  GuestStopper
	log     func(msg string, args ...any)
	// dial says whether a peer answers; a TCP connect by default.
	dial func(ctx context.Context, addr string) bool
	// confirm: how long no peer must answer (default 3 s).
	confirm time.Duration
}

var _ GuestStopper = (*handler.Handler)(nil)

func (f *fencer) Name() string { return "self-fence" }

func (f *fencer) Run(ctx context.Context) error {
	if f.dial == nil {
		f.dial = func(ctx context.Context, addr string) bool {
			ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err != nil {
				return false
			}
			c.Close()
			return true
		}
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	if f.confirm == 0 {
		f.confirm = 3 * time.Second
	}
	var fencedFor time.Time   // the renewal an outage started after
	var silentSince time.Time // no peer has answered since (zero: one did)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		renewed := f.renewed()
		if renewed.IsZero() || renewed.Equal(fencedFor) {
			continue
		}
		now := time.Now()
		if now.Sub(renewed) <= f.window {
			silentSince = time.Time{}
			continue
		}
		peers := f.peers()
		reachable := 0
		if f.anyPeerAnswers(ctx, peers) {
			reachable = 1
		}
		if !fencing.ShouldFence(now, renewed, f.window, len(peers), reachable) {
			silentSince = time.Time{}
			continue
		}
		if silentSince.IsZero() {
			silentSince = now
		}
		if now.Sub(silentSince) < f.confirm {
			continue
		}
		fencedFor, silentSince = renewed, time.Time{}
		n, err := f.guests.StopGuests(ctx)
		f.log("self-fencing: lease not renewed and no peer reachable, guests stopped",
			"lastRenewal", renewed, "window", f.window, "peers", len(peers), "stopped", n, "err", fmt.Sprint(err))
	}
}

// anyPeerAnswers dials every peer at once and says whether one answered.
func (f *fencer) anyPeerAnswers(ctx context.Context, peers []string) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	answered := make(chan bool, len(peers))
	for _, p := range peers {
		go func() { answered <- f.dial(ctx, p) }()
	}
	for range peers {
		if <-answered {
			return true
		}
	}
	return false
}
