package rbac

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
)

// legacyNodeSecrets is the cluster role (and the name of its per-namespace
// bindings) through which earlier releases let nodes get any Secret of a
// user namespace. Nodes now read Secrets only through the brain's
// nodereads API; RemoveLegacyNodeSecretAccess deletes what is left of it.
const legacyNodeSecrets = "nodevirt:nodeagent:secrets"

// RemoveLegacyNodeSecretAccess deletes the legacy node Secret role and its
// bindings in every namespace; what is gone already is fine.
func RemoveLegacyNodeSecretAccess(ctx context.Context, kube kubernetes.Interface) error {
	bindings, err := kube.RbacV1().RoleBindings(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", legacyNodeSecrets).String()})
	if err != nil {
		return fmt.Errorf("list rolebindings %s: %w", legacyNodeSecrets, err)
	}
	var errs []error
	for _, b := range bindings.Items {
		if b.RoleRef.Name != legacyNodeSecrets || b.Labels["app.kubernetes.io/managed-by"] != "nodevirt" {
			continue
		}
		if err := kube.RbacV1().RoleBindings(b.Namespace).Delete(ctx, b.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("delete rolebinding %s/%s: %w", b.Namespace, b.Name, err))
		}
	}
	if err := kube.RbacV1().ClusterRoles().Delete(ctx, legacyNodeSecrets, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		errs = append(errs, fmt.Errorf("delete clusterrole %s: %w", legacyNodeSecrets, err))
	}
	return errors.Join(errs...)
}

// DaemonRoles is a brain role: at start it installs (repairs) the daemons'
// roles and node restriction and removes the legacy node Secret access
// (EnsureDaemons), then idles.
type DaemonRoles struct {
	kube kubernetes.Interface
	log  *slog.Logger
}

// NewDaemonRoles builds the role.
func NewDaemonRoles(kube kubernetes.Interface, log *slog.Logger) (*DaemonRoles, error) {
	if kube == nil {
		return nil, errors.New("rbac: kube client is required")
	}
	if log == nil {
		log = slog.Default()
	}
	return &DaemonRoles{kube: kube, log: log.With("role", "daemon-roles")}, nil
}

// Name implements the daemon role.
func (a *DaemonRoles) Name() string { return "daemon-roles" }

// Run installs the roles and waits for ctx to end.
func (a *DaemonRoles) Run(ctx context.Context) error {
	if err := EnsureDaemons(ctx, a.kube); err != nil {
		// Without escalate/bind the brain cannot repair them; the
		// administrator's installation stands.
		a.log.Warn("daemon roles not ensured", "err", err)
	}
	<-ctx.Done()
	return nil
}
