package agent

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

type countingStopper struct{ calls atomic.Int32 }

func (c *countingStopper) StopGuests(context.Context) (int, error) { c.calls.Add(1); return 1, nil }

// TestFencerStopsOnceWhenCutOff: past the window with no peer answering the
// guests are stopped, once per outage; a peer that answers (the API server
// is down for everyone) keeps them running.
func TestFencerStopsOnceWhenCutOff(t *testing.T) {
	for _, tc := range []struct {
		name      string
		peerAlive bool
		want      int32
	}{{"cut off", false, 1}, {"api server down for everyone", true, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			g := &countingStopper{}
			renewed := time.Now().Add(-10 * time.Second)
			f := &fencer{window: 5 * time.Second, renewed: func() time.Time { return renewed },
				peers: func() []string { return []string{"peer:1"} }, guests: g, log: func(string, ...any) {},
				dial: func(context.Context, string) bool { return tc.peerAlive }}
			ctx, cancel := context.WithTimeout(context.Background(), 3500*time.Millisecond)
			defer cancel()
			_ = f.Run(ctx)
			if got := g.calls.Load(); got != tc.want {
				t.Fatalf("guests stopped %d times, want %d", got, tc.want)
			}
		})
	}
}
