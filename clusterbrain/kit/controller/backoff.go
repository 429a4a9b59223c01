package controller

import (
	"fmt"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/client-go/util/workqueue"
)

// Backoff is how long a key whose sync failed waits before it is synced
// again: Base after the first failure, doubling per further failure, at
// most Max. A success resets the key's count.
type Backoff struct {
	Base, Max time.Duration
	// Shared, when set, also limits the retries of all keys together to
	// SharedQPS per second (bursts of SharedBurst), so a failing API
	// server is not hammered by every key at once.
	Shared                 bool
	SharedQPS, SharedBurst int
}

// The back-offs nodevirt's controllers use, named by what they suit.
var (
	// BackoffAPI suits a controller whose work is API writes: 5 ms
	// doubling to 1000 s per key, and at most 10 retries per second
	// (bursts of 100) across keys (client-go's default for controllers).
	BackoffAPI = Backoff{Base: 5 * time.Millisecond, Max: 1000 * time.Second, Shared: true, SharedQPS: 10, SharedBurst: 100}
	// BackoffPlacement suits the scheduler: 50 ms doubling to 30 s, so a
	// placement that failed on a stale cache is retried almost at once
	// and one that keeps failing is still looked at twice a minute.
	BackoffPlacement = Backoff{Base: 50 * time.Millisecond, Max: 30 * time.Second}
	// BackoffNodeLocal suits a node agent's work on its own host (libvirt,
	// files): 200 ms doubling to 30 s.
	BackoffNodeLocal = Backoff{Base: 200 * time.Millisecond, Max: 30 * time.Second}
	// BackoffSlowLocal suits node-local work that takes long and fails
	// for long (a snapshot waiting for its volume): 200 ms doubling to
	// 2 minutes.
	BackoffSlowLocal = Backoff{Base: 200 * time.Millisecond, Max: 2 * time.Minute}
)

func (b Backoff) validate() error {
	if b.Base <= 0 || b.Max < b.Base {
		return fmt.Errorf("backoff %v..%v: base must be positive and at most max", b.Base, b.Max)
	}
	if b.Shared && (b.SharedQPS <= 0 || b.SharedBurst <= 0) {
		return fmt.Errorf("backoff: shared limit %d/s burst %d must be positive", b.SharedQPS, b.SharedBurst)
	}
	return nil
}

// limiter is the workqueue rate limiter b describes.
func (b Backoff) limiter() workqueue.TypedRateLimiter[string] {
	perKey := workqueue.NewTypedItemExponentialFailureRateLimiter[string](b.Base, b.Max)
	if !b.Shared {
		return perKey
	}
	return workqueue.NewTypedMaxOfRateLimiter(perKey,
		&workqueue.TypedBucketRateLimiter[string]{Limiter: rate.NewLimiter(rate.Limit(b.SharedQPS), b.SharedBurst)})
}
