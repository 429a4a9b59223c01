package agent

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

type countingStopper struct{ calls atomic.Int32 }

func (c *countingStopper) StopGuests(context.Context) (int, error) { c.calls.Add(1); return 1, nil }

// TestFencerStopsOnceWhenCutOff: past the window with no peer answering for
// the confirmation time the guests are stopped, once per outage; a peer that
// answers (the API server is down for everyone), or that misses a check
// and answers the next, keeps them running.
func TestFencerStopsOnceWhenCutOff(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer func(check int) bool
		want   int32
	}{
		{"cut off", func(int) bool { return false }, 1},
		{"api server down for everyone", func(int) bool { return true }, 0},
		{"a busy peer misses a check", func(check int) bool { return check%2 == 0 }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &countingStopper{}
			renewed := time.Now().Add(-10 * time.Second)
			var checks atomic.Int32
			f := &fencer{window: 5 * time.Second, renewed: func() time.Time { return renewed }, confirm: 1500 * time.Millisecond,
				peers: func() []string { return []string{"peer:1", "peer:2"} }, guests: g, log: func(string, ...any) {},
				dial: func(_ context.Context, addr string) bool {
					return addr == "peer:2" && tc.answer(int(checks.Add(1)))
				}}
			ctx, cancel := context.WithTimeout(context.Background(), 4500*time.Millisecond)
			defer cancel()
			_ = f.Run(ctx)
			if got := g.calls.Load(); got != tc.want {
				t.Fatalf("guests stopped %d times, want %d", got, tc.want)
			}
		})
	}
}
