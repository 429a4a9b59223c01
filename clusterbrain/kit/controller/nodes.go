package controller

import (
	"context"

	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Shared is an informer a role reads: the one the brain shares among the
// roles of a leader term, or, when the role runs alone (its tests, a
// program of its own), one the role made and runs itself.
type Shared struct {
	cache.SharedIndexInformer
	own bool
}

// Share returns shared when the brain gave one, else the informer newOwn
// makes, the role's own.
func Share(shared cache.SharedIndexInformer, newOwn func() cache.SharedIndexInformer) Shared {
	if shared != nil {
		return Shared{SharedIndexInformer: shared}
	}
	return Shared{SharedIndexInformer: newOwn(), own: true}
}

// SharedNodes is Share of an informer of every Node.
func SharedNodes(kube kubernetes.Interface, shared cache.SharedIndexInformer) Shared {
	return Share(shared, func() cache.SharedIndexInformer {
		return coreinformers.NewNodeInformer(kube, 0, cache.Indexers{})
	})
}

// RunOwn runs the informer until ctx ends when the role made it; the
// brain runs a shared one.
func (s Shared) RunOwn(ctx context.Context) {
	if s.own {
		go s.RunWithContext(ctx)
	}
}
