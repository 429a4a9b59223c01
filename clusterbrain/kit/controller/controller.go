// Package controller is the kit nodevirt's controllers are built from,
// sample-controller's shape factored once: a typed rate-limited workqueue
// with a named Backoff, informer handlers that feed it keys, a worker loop
// that applies one result policy, and an event Recorder.
//
// A controller writes only its sync function (key → requeue-after, error)
// and its informer wiring:
//
//	q, err := controller.New(controller.Config{Name: "migrations", Sync: c.sync, Backoff: controller.BackoffAPI})
//	_, _ = informer.AddEventHandler(controller.OnChange(q.Enqueue))
//	...
//	return q.Run(ctx, informer.HasSynced) // blocks until ctx ends
//
// The result policy: an error retries the key after its back-off (logged
// at warn, or debug when Config.Quiet says the retry will resolve it); a
// positive duration syncs the key again after it; otherwise the key waits
// for its next change. An error while ctx is ending is dropped, since the
// queue is shutting down.
//
// The kit imports nothing of either daemon, so both use it.
package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

// SyncFunc reconciles the object named key and returns when it wants to be
// synced again (0: on its next change).
type SyncFunc func(ctx context.Context, key string) (time.Duration, error)

// NoRequeue adapts a sync function that never asks to be synced again.
func NoRequeue(sync func(ctx context.Context, key string) error) SyncFunc {
	return func(ctx context.Context, key string) (time.Duration, error) { return 0, sync(ctx, key) }
}

// Config describes one queue and its workers.
type Config struct {
	// Name names the queue (workqueue metrics) and the controller in log
	// lines and errors.
	Name string
	Sync SyncFunc
	// Backoff is the retry policy of a failed key (required: one of the
	// named Backoff values, or one of the controller's own).
	Backoff Backoff
	// Workers is how many keys are synced at once (default 1).
	Workers int
	Log     *slog.Logger
	// KeyAttr is the log attribute that carries the key ("vm",
	// "migration"; default "key").
	KeyAttr string
	// Observe, when set, sees the result of every sync (nil on success),
	// for example to count reconciles.
	Observe func(err error)
	// Quiet, when set and true for an error, logs that failure at debug
	// level: the retry is expected to resolve it (a conflict with a newer
	// version the cache has not shown yet).
	Quiet func(err error) bool
}

func (c *Config) defaults() error {
	if c.Name == "" || c.Sync == nil {
		return errors.New("controller: name and sync are required")
	}
	if err := c.Backoff.validate(); err != nil {
		return fmt.Errorf("controller %s: %w", c.Name, err)
	}
	if c.Workers == 0 {
		c.Workers = 1
	}
	if c.Workers < 0 {
		return fmt.Errorf("controller %s: workers %d must be positive", c.Name, c.Workers)
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.KeyAttr == "" {
		c.KeyAttr = "key"
	}
	return nil
}

// Queue holds the keys waiting to be synced and runs the workers that
// sync them.
type Queue struct {
	cfg   Config
	queue workqueue.TypedRateLimitingInterface[string]
}

// New validates cfg and builds the queue; Run starts its workers.
func New(cfg Config) (*Queue, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	return &Queue{cfg: cfg, queue: workqueue.NewTypedRateLimitingQueueWithConfig(cfg.Backoff.limiter(),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: cfg.Name})}, nil
}

// Add queues key for a sync.
func (q *Queue) Add(key string) { q.queue.Add(key) }

// AddAfter queues key for a sync once d has passed.
func (q *Queue) AddAfter(key string, d time.Duration) { q.queue.AddAfter(key, d) }

// Retry queues key after its back-off, as a failed sync does; for work
// a sync started and that failed later (a binding running on its own).
func (q *Queue) Retry(key string) { q.queue.AddRateLimited(key) }

// Len is the number of keys waiting.
func (q *Queue) Len() int { return q.queue.Len() }

// ShutDown stops the queue; for a Run that returns before Queue.Run
// (which shuts the queue down itself).
func (q *Queue) ShutDown() { q.queue.ShutDown() }

// Enqueue queues the namespace/name key of obj (a tombstone's object
// included); it suits OnChange.
func (q *Queue) Enqueue(obj any) {
	if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
		q.queue.Add(key)
	}
}

// Run waits for the caches of synced, then syncs keys with the configured
// workers until ctx ends or ShutDown is called. It shuts the queue down and returns once every
// worker has; the error says the caches did not sync before ctx ended.
func (q *Queue) Run(ctx context.Context, synced ...cache.InformerSynced) error {
	defer q.queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return fmt.Errorf("%s: caches did not sync: %w", q.cfg.Name, ctx.Err())
	}
	var wg sync.WaitGroup
	for range q.cfg.Workers {
		wg.Go(func() {
			for q.processNext(ctx) {
			}
		})
	}
	stopped := make(chan struct{})
	go func() { wg.Wait(); close(stopped) }()
	select {
	case <-ctx.Done():
		q.queue.ShutDown()
		<-stopped
	case <-stopped: // ShutDown was called
	}
	return nil
}

// processNext syncs one key; it reports false once the queue is shut down.
func (q *Queue) processNext(ctx context.Context) bool {
	key, quit := q.queue.Get()
	if quit {
		return false
	}
	defer q.queue.Done(key)
	after, err := q.cfg.Sync(ctx, key)
	if q.cfg.Observe != nil {
		q.cfg.Observe(err)
	}
	switch {
	case err != nil && ctx.Err() != nil:
		// Shutting down: the retry would not run.
	case err != nil:
		level := slog.LevelWarn
		if q.cfg.Quiet != nil && q.cfg.Quiet(err) {
			level = slog.LevelDebug
		}
		q.cfg.Log.Log(ctx, level, "sync failed", "controller", q.cfg.Name, q.cfg.KeyAttr, key, "err", err)
		q.queue.AddRateLimited(key)
	case after > 0:
		q.queue.Forget(key)
		q.queue.AddAfter(key, after)
	default:
		q.queue.Forget(key)
	}
	return true
}

// OnChange returns informer handlers that call f with every added object,
// the new copy of every updated one and every deleted one (a tombstone
// unwrapped to its last known state).
func OnChange(f func(obj any)) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    f,
		UpdateFunc: func(_, obj any) { f(obj) },
		DeleteFunc: func(obj any) { f(Unwrap(obj)) },
	}
}

// OnAddOrUpdate is OnChange without deletions, for controllers that have
// nothing to do once the object is gone.
func OnAddOrUpdate(f func(obj any)) cache.ResourceEventHandlerFuncs {
	h := OnChange(f)
	h.DeleteFunc = nil
	return h
}

// Unwrap returns the last known state of a deleted object when obj is a
// tombstone, else obj.
func Unwrap(obj any) any {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		return d.Obj
	}
	return obj
}

// OwnerKey returns the namespace/name key of obj's controller when that
// controller is of kind (obj may be a tombstone).
func OwnerKey(obj any, kind string) (string, bool) {
	m, ok := Unwrap(obj).(metav1.Object)
	if !ok {
		return "", false
	}
	ref := metav1.GetControllerOf(m)
	if ref == nil || ref.Kind != kind {
		return "", false
	}
	return m.GetNamespace() + "/" + ref.Name, true
}
