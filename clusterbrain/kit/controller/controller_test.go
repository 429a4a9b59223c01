package controller

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestBackoffs(t *testing.T) {
	for _, tc := range []struct {
		name      string
		b         Backoff
		first, at time.Duration // delay after 1 and after 20 failures
	}{
		{"api", BackoffAPI, 5 * time.Millisecond, 1000 * time.Second},
		{"placement", BackoffPlacement, 50 * time.Millisecond, 30 * time.Second},
		{"node-local", BackoffNodeLocal, 200 * time.Millisecond, 30 * time.Second},
		{"slow-local", BackoffSlowLocal, 200 * time.Millisecond, 2 * time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.b.validate(); err != nil {
				t.Fatal(err)
			}
			l := tc.b.limiter()
			if got := l.When("k"); got != tc.first {
				t.Errorf("first retry after %v, want %v", got, tc.first)
			}
			for range 18 {
				l.When("k")
			}
			if got := l.When("k"); got != tc.at {
				t.Errorf("20th retry after %v, want %v", got, tc.at)
			}
			l.Forget("k")
			if got := l.When("k"); got != tc.first {
				t.Errorf("after a success: %v, want %v", got, tc.first)
			}
		})
	}
}

func TestConfigValidation(t *testing.T) {
	sync := NoRequeue(func(context.Context, string) error { return nil })
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no name", Config{Sync: sync, Backoff: BackoffAPI}},
		{"no sync", Config{Name: "x", Backoff: BackoffAPI}},
		{"no backoff", Config{Name: "x", Sync: sync}},
		{"max below base", Config{Name: "x", Sync: sync, Backoff: Backoff{Base: time.Second, Max: time.Millisecond}}},
		{"shared without rate", Config{Name: "x", Sync: sync, Backoff: Backoff{Base: 1, Max: 2, Shared: true}}},
		{"negative workers", Config{Name: "x", Sync: sync, Backoff: BackoffAPI, Workers: -1}},
	} {
		if _, err := New(tc.cfg); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

// TestResultPolicy drives one key through each result of a sync.
func TestResultPolicy(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name     string
		after    time.Duration
		err      error
		cancel   bool
		requeues int  // the key's failure count afterwards
		again    bool // the key comes back (soon)
	}{
		{name: "success forgets", requeues: 0},
		{name: "error retries after back-off", err: boom, requeues: 1, again: true},
		{name: "requeue after", after: 10 * time.Millisecond, requeues: 0, again: true},
		{name: "error while stopping is dropped", err: boom, cancel: true, requeues: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var seen []error
			q, err := New(Config{Name: "test", Backoff: Backoff{Base: time.Millisecond, Max: time.Millisecond},
				Sync:    func(context.Context, string) (time.Duration, error) { return tc.after, tc.err },
				Observe: func(err error) { seen = append(seen, err) }})
			if err != nil {
				t.Fatal(err)
			}
			defer q.queue.ShutDown()
			ctx, cancel := context.WithCancel(t.Context())
			if tc.cancel {
				cancel()
			}
			defer cancel()
			q.Add("ns/a")
			if !q.processNext(ctx) {
				t.Fatal("queue shut down")
			}
			if len(seen) != 1 || !errors.Is(seen[0], tc.err) && tc.err != nil {
				t.Errorf("observed %v", seen)
			}
			if got := q.queue.NumRequeues("ns/a"); got != tc.requeues {
				t.Errorf("requeues = %d, want %d", got, tc.requeues)
			}
			time.Sleep(50 * time.Millisecond)
			if got := q.Len() == 1; got != tc.again {
				t.Errorf("key back in the queue: %v, want %v", got, tc.again)
			}
		})
	}
}

func TestRunSyncsAndStops(t *testing.T) {
	var mu sync.Mutex
	synced := map[string]int{}
	q, err := New(Config{Name: "test", Backoff: BackoffAPI, Workers: 3,
		Sync: NoRequeue(func(_ context.Context, key string) error {
			mu.Lock()
			defer mu.Unlock()
			synced[key]++
			return nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	store := cache.NewStore(cache.MetaNamespaceKeyFunc)
	h := OnChange(q.Enqueue)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"}}
	_ = store.Add(pod)
	h.OnAdd(pod, false)
	h.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/q", Obj: &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "q"}}})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- q.Run(ctx, func() bool { return true }) }()
	testkit.Until(t, 10*time.Second, "both keys synced", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return synced["ns/p"] == 1 && synced["ns/q"] == 1
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !q.queue.ShuttingDown() {
		t.Error("queue not shut down after Run")
	}
}

func TestRunWithoutSync(t *testing.T) {
	q, _ := New(Config{Name: "test", Backoff: BackoffAPI, Sync: NoRequeue(func(context.Context, string) error { return nil })})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := q.Run(ctx, func() bool { return false }); !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want the cancellation", err)
	}
}

func TestOwnerKey(t *testing.T) {
	yes := true
	owned := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "virt-launcher-x",
		OwnerReferences: []metav1.OwnerReference{{Kind: "VirtualMachine", Name: "vm", Controller: &yes}}}}
	for _, tc := range []struct {
		name string
		obj  any
		kind string
		key  string
	}{
		{"owned", owned, "VirtualMachine", "ns/vm"},
		{"tombstone", cache.DeletedFinalStateUnknown{Obj: owned}, "VirtualMachine", "ns/vm"},
		{"other kind", owned, "DataVolume", ""},
		{"no owner", &corev1.Pod{}, "VirtualMachine", ""},
		{"not an object", "x", "VirtualMachine", ""},
	} {
		key, ok := OwnerKey(tc.obj, tc.kind)
		if key != tc.key || ok != (tc.key != "") {
			t.Errorf("%s: OwnerKey = %q, %v; want %q", tc.name, key, ok, tc.key)
		}
	}
}

func TestShutDownEndsRun(t *testing.T) {
	q, _ := New(Config{Name: "test", Backoff: BackoffAPI, Sync: NoRequeue(func(context.Context, string) error { return nil })})
	done := make(chan error, 1)
	go func() { done <- q.Run(t.Context()) }()
	q.ShutDown()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run still running after ShutDown")
	}
}
