package rbac

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// NodeSecretBinding is the RoleBinding NodeSecretAccess keeps in each
// namespace.
const NodeSecretBinding = NodeAgentSecretsRole

// NodeSecretAccess is a brain role: it installs the daemons' roles
// (EnsureDaemons) and keeps, in every namespace but the brain's and the
// system ones, a RoleBinding giving identity.NodesGroup NodeAgentSecretsRole, so
// nodes read the Secrets VMs and imports name in users' namespaces but
// never the brain's own (the node CA key, webhook and token keys).
type NodeSecretAccess struct {
	kube     kubernetes.Interface
	excluded []string
	log      *slog.Logger
	queue    *controller.Queue
	nss      cache.SharedIndexInformer
}

// NewNodeSecretAccess builds the role; brainNamespace is never granted.
func NewNodeSecretAccess(kube kubernetes.Interface, brainNamespace string, log *slog.Logger) (*NodeSecretAccess, error) {
	if kube == nil || brainNamespace == "" {
		return nil, errors.New("rbac: kube client and brain namespace are required")
	}
	if log == nil {
		log = slog.Default()
	}
	a := &NodeSecretAccess{kube: kube, log: log.With("role", "node-secret-access"),
		excluded: []string{brainNamespace, "kube-system", "kube-public", NodeLeaseNamespace}}
	var err error
	a.queue, err = controller.New(controller.Config{Name: "node-secret-access", Sync: controller.NoRequeue(a.sync),
		Backoff: controller.BackoffAPI, Log: a.log, KeyAttr: "namespace"})
	if err != nil {
		return nil, err
	}
	a.nss = informers.NewSharedInformerFactory(kube, 10*time.Minute).Core().V1().Namespaces().Informer()
	enqueue := func(obj any) {
		if ns, ok := obj.(*corev1.Namespace); ok {
			a.queue.Add(ns.Name)
		}
	}
	if _, err := a.nss.AddEventHandler(controller.OnAddOrUpdate(enqueue)); err != nil {
		return nil, err
	}
	return a, nil
}

// Name implements the daemon role.
func (a *NodeSecretAccess) Name() string { return "node-secret-access" }

// Run installs the daemons' roles and keeps the bindings until ctx ends.
func (a *NodeSecretAccess) Run(ctx context.Context) error {
	if err := EnsureDaemons(ctx, a.kube); err != nil {
		// Without escalate/bind the brain cannot repair them; the
		// administrator's installation stands.
		a.log.Warn("daemon roles not ensured", "err", err)
	}
	go a.nss.RunWithContext(ctx)
	if err := a.queue.Run(ctx, a.nss.HasSynced); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

func (a *NodeSecretAccess) sync(ctx context.Context, ns string) error {
	obj, exists, err := a.nss.GetIndexer().GetByKey(ns)
	if err != nil || !exists {
		return err
	}
	if obj.(*corev1.Namespace).Status.Phase == corev1.NamespaceTerminating {
		return nil
	}
	if slices.Contains(a.excluded, ns) {
		err := a.kube.RbacV1().RoleBindings(ns).Delete(ctx, NodeSecretBinding, metav1.DeleteOptions{})
		if err == nil {
			a.log.Warn("removed node secret access from a protected namespace", "namespace", ns)
		}
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	return ensureRoleBinding(ctx, a.kube, ns, NodeSecretBinding, NodeAgentSecretsRole, identity.NodesGroup)
}
