package daemon

import (
	"context"
	"log/slog"
	"sync"
)

// Role is one job of a daemon. Run blocks until ctx ends.
type Role interface {
	Name() string
	Run(ctx context.Context) error
}

// Start runs every role in its own goroutine until ctx ends. A role that
// stops early with an error is logged and marked unhealthy in h (when h is
// not nil). Wait on the returned group for all of them to return.
func Start(ctx context.Context, log *slog.Logger, h *Health, roles ...Role) *sync.WaitGroup {
	var wg sync.WaitGroup
	for _, r := range roles {
		wg.Add(1)
		go func(r Role) {
			defer wg.Done()
			if err := r.Run(ctx); err != nil && ctx.Err() == nil {
				log.Error("role stopped", "role", r.Name(), "err", err)
				if h != nil {
					h.Set(r.Name(), err)
				}
			}
		}(r)
	}
	return &wg
}
