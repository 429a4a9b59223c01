// Package crwatch hands the cluster's KubeVirt and CDI CRs, as they change,
// to the parts of a daemon that follow their configuration live (TLS
// settings, log verbosity): one watch of each kind for all of them.
//
// A consumer is called with the CR in force after every change: the first
// one not being deleted (a cluster has one of each, made by the hco role),
// or nil when there is none, so a deleted CR puts the consumer back to its
// defaults. Consumers are called from the informers' goroutines, one call
// at a time per kind; they must not block.
package crwatch

import (
	"context"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
)

// Watch follows the KubeVirt and CDI CRs. Add consumers before Run.
type Watch struct {
	virt     *client.Set
	ns       string
	kubevirt []func(*kubevirtv1.KubeVirt)
	cdi      []func(*cdiv1.CDI)
}

// New watches with virt's clients the KubeVirt CRs of namespace ns (the
// brain's, where the hco role renders it; "": every namespace) and the CDI
// CRs.
func New(virt *client.Set, ns string) *Watch { return &Watch{virt: virt, ns: ns} }

// OnKubeVirt adds a consumer of the KubeVirt CR.
func (w *Watch) OnKubeVirt(f func(*kubevirtv1.KubeVirt)) { w.kubevirt = append(w.kubevirt, f) }

// OnCDI adds a consumer of the CDI CR.
func (w *Watch) OnCDI(f func(*cdiv1.CDI)) { w.cdi = append(w.cdi, f) }

// Name names the role.
func (w *Watch) Name() string { return "cluster-config" }

// Run watches until ctx ends.
func (w *Watch) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	if len(w.kubevirt) > 0 {
		inf := w.virt.KubeVirts.Informer(w.ns, 0, nil)
		follow(inf, w.kubevirt)
		wg.Add(1)
		go func() { defer wg.Done(); inf.RunWithContext(ctx) }()
	}
	if len(w.cdi) > 0 {
		inf := w.virt.CDIs.Informer("", 0, nil)
		follow(inf, w.cdi)
		wg.Add(1)
		go func() { defer wg.Done(); inf.RunWithContext(ctx) }()
	}
	<-ctx.Done()
	wg.Wait()
	return nil
}

// object is a kind Watch follows.
type object interface {
	*kubevirtv1.KubeVirt | *cdiv1.CDI
	GetDeletionTimestamp() *metav1.Time
}

// follow calls every consumer with the live object of inf's store after
// each event.
func follow[T object](inf cache.SharedIndexInformer, consumers []func(T)) {
	var mu sync.Mutex
	changed := func() {
		mu.Lock()
		defer mu.Unlock()
		cur := Live[T](inf.GetStore().List())
		for _, f := range consumers {
			f(cur)
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { changed() },
		UpdateFunc: func(any, any) { changed() },
		DeleteFunc: func(any) { changed() },
	})
}

// Live is the first object of objs of type T not being deleted, or nil.
func Live[T object](objs []any) T {
	var zero T
	for _, o := range objs {
		if t, ok := o.(T); ok && t != zero && t.GetDeletionTimestamp() == nil {
			return t
		}
	}
	return zero
}
