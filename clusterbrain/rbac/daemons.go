package rbac

import (
	"context"
	"fmt"

	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
)

// The daemons' roles.
const (
	// NodeAgentRole is what every node needs, cluster-wide.
	NodeAgentRole = "nodevirt:nodeagent"
	// NodeAgentLeaseRole lets nodes keep their Lease in kube-node-lease.
	NodeAgentLeaseRole = "nodevirt:nodeagent:lease"
	// BrainRole is what the brain needs.
	BrainRole = "nodevirt:clusterbrain"
)

// volumeSnapshot is the CSI snapshot API group.
const volumeSnapshot = "snapshot.storage.k8s.io"

// NodeLeaseNamespace is where node Leases live.
const NodeLeaseNamespace = "kube-node-lease"

// NodeAgentRules are the nodeagent's permissions (without Leases, bound
// in their namespace). Nodes get no Secret or ConfigMap: they read those
// their VMIs and DataVolumes name through the brain (package
// clusterbrain/api/nodereads), which checks that the referrer is on the
// reading node.
func NodeAgentRules() []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		// Its Node: registration, bridge resources, endpoint annotations.
		rule("", []string{"nodes"}, "get", "list", "watch", "create", "update", "patch"),
		rule("", []string{"nodes/status"}, "get", "update", "patch"),
		// The virt-handler role.
		rule(core, []string{"virtualmachineinstances"}, "get", "list", "watch", "update", "patch"),
		rule(core, []string{"virtualmachineinstances/status"}, "get", "update", "patch"),
		rule(core, []string{"kubevirts"}, read...),
		// Its part in live migrations (package migstate).
		rule(core, []string{"virtualmachineinstancemigrations"}, read...),
		rule(core, []string{"virtualmachineinstancemigrations/status"}, "get", "update", "patch"),
		rule("k8s.cni.cncf.io", []string{"network-attachment-definitions"}, read...),
		// The volumes it serves: provisioner, CSI, importer.
		rule("", []string{"persistentvolumeclaims"}, "get", "list", "watch", "update", "patch"),
		rule("", []string{"persistentvolumeclaims/status"}, "get", "update", "patch"),
		rule("", []string{"persistentvolumes"}, "get", "list", "watch", "create", "update", "patch", "delete"),
		rule("storage.k8s.io", []string{"storageclasses"}, read...),
		rule("cdi.kubevirt.io", []string{"datavolumes", "cdis", "cdiconfigs"}, read...),
		// The storage pools of HostPathProvisioners (package poolstate).
		rule("hostpathprovisioner.kubevirt.io", []string{"hostpathprovisioners"}, read...),
		// The snapshotter role (snapshot-controller and csi-snapshotter of
		// its volumes) and restores by the provisioner.
		rule(volumeSnapshot, []string{"volumesnapshots"}, "get", "list", "watch", "update", "patch"),
		rule(volumeSnapshot, []string{"volumesnapshots/status", "volumesnapshotcontents/status"}, "get", "update", "patch"),
		rule(volumeSnapshot, []string{"volumesnapshotcontents"}, "get", "list", "watch", "create", "update", "patch", "delete"),
		rule(volumeSnapshot, []string{"volumesnapshotclasses"}, read...),
		// Secrets and ConfigMaps of what is on the node, through the brain.
		rule(nodereads.Group, nodereads.Subresources, "get"),
		// Its own certificate (nodevirt.io/node signer).
		rule("certificates.k8s.io", []string{"certificatesigningrequests"}, "create", "get"),
		// Events of its own (source.host: the node restriction).
		rule("", []string{"events"}, "create", "update", "patch"),
	}
}

// BrainRules are the brain's permissions: the API it installs, the objects
// it reconciles, the aggregated APIs' delegated authentication and
// authorization, and node certificate signing.
func BrainRules() []rbacv1.PolicyRule {
	all := []string{"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
	return []rbacv1.PolicyRule{
		rule(core, []string{"*"}, all...),
		rule(subresources, []string{"*"}, all...),
		rule(snapshot, []string{"*"}, all...),
		rule(volumeSnapshot, []string{"*"}, all...), // CSI snapshots: restores, the default class
		rule(instancetype, []string{"*"}, all...),
		rule(pool, []string{"*"}, all...),
		rule(clone, []string{"*"}, all...),
		rule(export, []string{"*"}, all...),
		rule(migrations, []string{"*"}, all...),
		rule("cdi.kubevirt.io", []string{"*"}, all...),
		rule("upload.cdi.kubevirt.io", []string{"*"}, all...),
		rule("hco.kubevirt.io", []string{"*"}, all...),
		rule("networkaddonsoperator.network.kubevirt.io", []string{"*"}, all...),
		rule("hostpathprovisioner.kubevirt.io", []string{"*"}, all...),
		rule("ssp.kubevirt.io", []string{"*"}, all...),
		rule("tekton.dev", []string{"tasks", "pipelines"}, all...), // the SSP's pipeline tasks
		rule("k8s.cni.cncf.io", []string{"*"}, all...),
		rule("nodevirt.io", []string{"*"}, all...), // the MAC pool's allocations
		rule("", []string{"nodes", "persistentvolumeclaims", "persistentvolumes", "namespaces"}, all...),
		rule("", []string{"secrets", "configmaps", "services", "endpoints", "serviceaccounts"}, all...),
		rule("", []string{"events", "pods"}, all...),
		// VMIs' LimitRange defaults and ResourceQuota (admission).
		rule("", []string{"resourcequotas", "limitranges"}, "get", "list", "watch"),
		rule("", []string{"nodes/status", "persistentvolumeclaims/status"}, "get", "update", "patch"),
		rule("events.k8s.io", []string{"events"}, all...),
		rule("discovery.k8s.io", []string{"endpointslices"}, all...),
		rule("coordination.k8s.io", []string{"leases"}, all...),
		rule("apps", []string{"controllerrevisions"}, all...),
		// Its own Deployment, placed by the HyperConverged's spec.infra.
		{APIGroups: []string{"apps"}, Resources: []string{"deployments"}, ResourceNames: []string{BrainDeployment},
			Verbs: []string{"get", "update", "patch"}},
		rule("storage.k8s.io", []string{"storageclasses", "csidrivers"}, all...),
		rule("apiextensions.k8s.io", []string{"customresourcedefinitions"}, all...),
		rule("apiregistration.k8s.io", []string{"apiservices"}, all...),
		rule("admissionregistration.k8s.io", []string{"mutatingwebhookconfigurations", "validatingwebhookconfigurations",
			"validatingadmissionpolicies", "validatingadmissionpolicybindings"}, all...),
		rule("authentication.k8s.io", []string{"tokenreviews"}, "create"),
		rule("authorization.k8s.io", []string{"subjectaccessreviews"}, "create"),
		// KubeVirt's roles and the daemons' (and removing the legacy
		// per-namespace node Secret bindings). bind/escalate: the brain
		// grants rules it does not use itself.
		rule("rbac.authorization.k8s.io", []string{"clusterroles", "clusterrolebindings", "roles", "rolebindings"},
			"get", "list", "watch", "create", "update", "patch", "delete", "bind", "escalate"),
		// Node certificates.
		rule("certificates.k8s.io", []string{"certificatesigningrequests"}, read...),
		rule("certificates.k8s.io", []string{"certificatesigningrequests/approval", "certificatesigningrequests/status"}, "update"),
		{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"signers"}, ResourceNames: []string{"nodevirt.io/node"},
			Verbs: []string{"approve", "sign"}},
	}
}

// DaemonClusterRoles are the daemons' cluster roles.
func DaemonClusterRoles() []*rbacv1.ClusterRole {
	mine := func(name string, rules ...rbacv1.PolicyRule) *rbacv1.ClusterRole {
		return &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}}, Rules: rules}
	}
	return []*rbacv1.ClusterRole{
		mine(NodeAgentRole, NodeAgentRules()...),
		mine(NodeAgentLeaseRole, rule("coordination.k8s.io", []string{"leases"}, "get", "create", "update", "patch")),
		mine(BrainRole, BrainRules()...),
	}
}

func groupBinding(name, role, group string) (meta metav1.ObjectMeta, ref rbacv1.RoleRef, subjects []rbacv1.Subject) {
	return metav1.ObjectMeta{Name: name, Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
		rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
		append([]rbacv1.Subject{{Kind: rbacv1.GroupKind, APIGroup: rbacv1.GroupName, Name: group}}, accountsOf(group)...)
}

// accountsOf is the in-cluster ServiceAccount that plays group's daemons
// (serviceaccounts.go), bound wherever the group is.
func accountsOf(group string) []rbacv1.Subject {
	switch group {
	case identity.NodesGroup:
		return []rbacv1.Subject{serviceAccountSubject(NodeAgentServiceAccount)}
	case identity.BrainGroup:
		return []rbacv1.Subject{serviceAccountSubject(BrainServiceAccount)}
	}
	return nil
}

// DaemonClusterRoleBindings bind NodeAgentRole to NodesGroup and the node
// agents' ServiceAccount, BrainRole to BrainGroup and the brain's.
func DaemonClusterRoleBindings() []*rbacv1.ClusterRoleBinding {
	var out []*rbacv1.ClusterRoleBinding
	for _, b := range [][2]string{{NodeAgentRole, identity.NodesGroup}, {BrainRole, identity.BrainGroup}} {
		m, r, s := groupBinding(b[0], b[0], b[1])
		out = append(out, &rbacv1.ClusterRoleBinding{ObjectMeta: m, RoleRef: r, Subjects: s})
	}
	return out
}

// EnsureDaemons installs the daemons' cluster roles and bindings, the
// node restriction policies and the nodes' Lease binding, and removes the
// legacy node Secret access. An administrator runs it once (the brain cannot
// grant itself its own role); the brain runs it again at start to repair
// drift.
func EnsureDaemons(ctx context.Context, kube kubernetes.Interface) error {
	if err := ensureClusterRoles(ctx, kube, DaemonClusterRoles()); err != nil {
		return err
	}
	if err := ensureClusterRoleBindings(ctx, kube, DaemonClusterRoleBindings()); err != nil {
		return err
	}
	if err := EnsureNodeRestriction(ctx, kube); err != nil {
		return err
	}
	if err := ensureRoleBinding(ctx, kube, NodeLeaseNamespace, NodeAgentLeaseRole, NodeAgentLeaseRole, identity.NodesGroup); err != nil {
		return err
	}
	return RemoveLegacyNodeSecretAccess(ctx, kube)
}

func ensureClusterRoles(ctx context.Context, kube kubernetes.Interface, want []*rbacv1.ClusterRole) error {
	roles := kube.RbacV1().ClusterRoles()
	for _, w := range want {
		cur, err := roles.Get(ctx, w.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			if _, err := roles.Create(ctx, w, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create clusterrole %s: %w", w.Name, err)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("read clusterrole %s: %w", w.Name, err)
		}
		if equality.Semantic.DeepEqual(cur.Rules, w.Rules) && labelsHave(cur.Labels, w.Labels) {
			continue
		}
		cur = cur.DeepCopy()
		cur.Rules, cur.Labels = w.Rules, merge(cur.Labels, w.Labels)
		if _, err := roles.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("update clusterrole %s: %w", w.Name, err)
		}
	}
	return nil
}

func ensureClusterRoleBindings(ctx context.Context, kube kubernetes.Interface, want []*rbacv1.ClusterRoleBinding) error {
	bindings := kube.RbacV1().ClusterRoleBindings()
	for _, w := range want {
		cur, err := bindings.Get(ctx, w.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			if _, err := bindings.Create(ctx, w, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create clusterrolebinding %s: %w", w.Name, err)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("read clusterrolebinding %s: %w", w.Name, err)
		}
		if equality.Semantic.DeepEqual(cur.Subjects, w.Subjects) && cur.RoleRef == w.RoleRef {
			continue
		}
		if cur.RoleRef != w.RoleRef { // immutable: replace
			if err := bindings.Delete(ctx, w.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("replace clusterrolebinding %s: %w", w.Name, err)
			}
			if _, err := bindings.Create(ctx, w, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("replace clusterrolebinding %s: %w", w.Name, err)
			}
			continue
		}
		cur = cur.DeepCopy()
		cur.Subjects = w.Subjects
		if _, err := bindings.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("update clusterrolebinding %s: %w", w.Name, err)
		}
	}
	return nil
}

// ensureRoleBinding binds cluster role to group in namespace as name.
func ensureRoleBinding(ctx context.Context, kube kubernetes.Interface, namespace, name, role, group string) error {
	m, r, s := groupBinding(name, role, group)
	m.Namespace = namespace
	want := &rbacv1.RoleBinding{ObjectMeta: m, RoleRef: r, Subjects: s}
	api := kube.RbacV1().RoleBindings(namespace)
	cur, err := api.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if _, err := api.Create(ctx, want, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create rolebinding %s/%s: %w", namespace, name, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("read rolebinding %s/%s: %w", namespace, name, err)
	}
	if equality.Semantic.DeepEqual(cur.Subjects, want.Subjects) && cur.RoleRef == want.RoleRef {
		return nil
	}
	if err := api.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("replace rolebinding %s/%s: %w", namespace, name, err)
	}
	if _, err := api.Create(ctx, want, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("replace rolebinding %s/%s: %w", namespace, name, err)
	}
	return nil
}
