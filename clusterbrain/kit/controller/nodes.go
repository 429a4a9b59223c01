package controller

import (
	"context"

	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Nodes is the Node informer a role reads: the one the brain shares among
// the roles of a leader term, or, when the role runs alone (its tests, a
// program of its own), one the role made and runs itself.
type Nodes struct {
	cache.SharedIndexInformer
	own bool
}

// SharedNodes returns shared when the brain gave one, else a Node
// informer of the role's own.
func SharedNodes(kube kubernetes.Interface, shared cache.SharedIndexInformer) Nodes {
	if shared != nil {
		return Nodes{SharedIndexInformer: shared}
	}
	return Nodes{SharedIndexInformer: coreinformers.NewNodeInformer(kube, 0, cache.Indexers{}), own: true}
}

// RunOwn runs the informer until ctx ends when the role made it; the
// brain runs a shared one.
func (n Nodes) RunOwn(ctx context.Context) {
	if n.own {
		go n.RunWithContext(ctx)
	}
}
