package brain

import (
	"context"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestTermsShareOneInformer: two terms of leadership in turn on one
// informer (of ConfigMaps here, the VMIs' in the brain) against a real API
// server. Each term's handler gets what was there when its term started,
// then what changes while it runs, and nothing after its term ended; a
// later term's role adds its index again without error; and the API
// server is listed once for both terms (a new informer per term listed
// every object again, and kept a cache of them beside the metrics
// server's).
func TestTermsShareOneInformer(t *testing.T) {
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	rc, requests := testkit.CountRequests(cp.RestConfig)
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	create := func(name string) {
		t.Helper()
		if _, err := kube.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}},
			metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	create("before")
	inf := coreinformers.NewConfigMapInformer(kube, ns, 0, cache.Indexers{})
	go inf.RunWithContext(ctx)

	// seen records the names a term's handler got.
	type seen struct {
		mu    sync.Mutex
		names map[string]bool
	}
	term := func() (*termInformer, *seen) {
		ti, s := newTermInformer(inf), &seen{names: map[string]bool{}}
		add := func(obj any) {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.names[obj.(*corev1.ConfigMap).Name] = true
		}
		if _, err := ti.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: add}); err != nil {
			t.Fatal(err)
		}
		byName := cache.Indexers{"by-name": func(obj any) ([]string, error) { return []string{obj.(*corev1.ConfigMap).Name}, nil }}
		if err := ti.AddIndexers(byName); err != nil {
			t.Fatalf("adding the term's index: %v", err)
		}
		return ti, s
	}
	has := func(s *seen, name string) bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.names[name]
	}

	first, s1 := term()
	// Built before its term: the handler gets nothing yet.
	create("unled")
	time.Sleep(time.Second)
	if has(s1, "before") || has(s1, "unled") || first.HasSynced() {
		t.Fatal("a term's handler got events before its term started")
	}
	ctx1, end1 := context.WithCancel(ctx)
	go first.RunWithContext(ctx1)
	testkit.Until(t, time.Minute, "the first term synced", first.HasSynced)
	if !has(s1, "before") || !has(s1, "unled") {
		t.Fatalf("the first term's handler got %v at its start, want every ConfigMap there", s1.names)
	}
	create("first")
	testkit.Until(t, time.Minute, "the first term's handler got a new ConfigMap", func() bool { return has(s1, "first") })
	end1()
	testkit.Until(t, time.Minute, "the first term ended", first.IsStopped)

	second, s2 := term()
	go second.RunWithContext(ctx)
	testkit.Until(t, time.Minute, "the second term synced", second.HasSynced)
	create("second")
	testkit.Until(t, time.Minute, "the second term's handler got every ConfigMap", func() bool {
		return has(s2, "before") && has(s2, "unled") && has(s2, "first") && has(s2, "second")
	})
	if has(s1, "second") {
		t.Fatal("the ended first term's handler still got events")
	}
	if got, err := second.GetIndexer().ByIndex("by-name", "second"); err != nil || len(got) != 1 {
		t.Fatalf("the index: %v, %v", got, err)
	}
	path := "/api/v1/namespaces/" + ns + "/configmaps"
	if n := requests.Lists(path); n != 1 {
		t.Fatalf("two terms listed the ConfigMaps %d times, want once", n)
	}
}
