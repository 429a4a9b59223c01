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
type fencer struct {
	window  time.Duration
	renewed func() time.Time
	peers   func() []string
	guests  GuestStopper
	log     func(msg string, args ...any)
	// dial says whether a peer answers; a TCP connect by default.
	dial func(ctx context.Context, addr string) bool
}

var _ GuestStopper = (*handler.Handler)(nil)

func (f *fencer) Name() string { return "self-fence" }

func (f *fencer) Run(ctx context.Context) error {
	if f.dial == nil {
		f.dial = func(ctx context.Context, addr string) bool {
			ctx, cancel := context.WithTimeout(ctx, time.Second)
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
	var fencedFor time.Time // the renewal an outage started after
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
			continue
		}
		peers := f.peers()
		reachable := 0
		for _, p := range peers {
			if f.dial(ctx, p) {
				reachable++
			}
		}
		if !fencing.ShouldFence(now, renewed, f.window, len(peers), reachable) {
			continue
		}
		fencedFor = renewed
		n, err := f.guests.StopGuests(ctx)
		f.log("self-fencing: lease not renewed and no peer reachable, guests stopped",
			"lastRenewal", renewed, "window", f.window, "peers", len(peers), "stopped", n, "err", fmt.Sprint(err))
	}
}
