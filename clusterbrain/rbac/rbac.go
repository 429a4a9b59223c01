// Package rbac holds KubeVirt's user-facing cluster roles —
// kubevirt.io:admin, kubevirt.io:edit, kubevirt.io:view (aggregated into
// Kubernetes' admin, edit and view), kubevirt.io:migrate and
// kubevirt.io:default — with the rules virt-operator installs, so the
// subresource API's access reviews answer as they do on KubeVirt.
package rbac

import (
	"context"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Role names.
const (
	Admin   = "kubevirt.io:admin"
	Edit    = "kubevirt.io:edit"
	View    = "kubevirt.io:view"
	Migrate = "kubevirt.io:migrate"
	Default = "kubevirt.io:default"
)

const (
	core         = "kubevirt.io"
	subresources = "subresources.kubevirt.io"
	snapshot     = "snapshot.kubevirt.io"
	backup       = "backup.kubevirt.io"
	export       = "export.kubevirt.io"
	clone        = "clone.kubevirt.io"
	instancetype = "instancetype.kubevirt.io"
	pool         = "pool.kubevirt.io"
	migrations   = "migrations.kubevirt.io"
)

var (
	all     = []string{"get", "delete", "create", "update", "patch", "list", "watch", "deletecollection"}
	editAll = []string{"get", "delete", "create", "update", "patch", "list", "watch"}
	read    = []string{"get", "list", "watch"}

	// Streams and guest-agent reads: "get" on the subresource.
	vmiGet = []string{
		"virtualmachineinstances/console", "virtualmachineinstances/vnc", "virtualmachineinstances/vnc/screenshot",
		"virtualmachineinstances/portforward", "virtualmachineinstances/guestosinfo",
		"virtualmachineinstances/filesystemlist", "virtualmachineinstances/userlist",
		"virtualmachineinstances/sev/fetchcertchain", "virtualmachineinstances/sev/querylaunchmeasurement",
		"virtualmachineinstances/usbredir", "virtualmachines/objectgraph", "virtualmachineinstances/objectgraph",
	}
	// Actions on running instances: "update".
	vmiUpdate = []string{
		"virtualmachineinstances/pause", "virtualmachineinstances/unpause", "virtualmachineinstances/addvolume",
		"virtualmachineinstances/removevolume", "virtualmachineinstances/freeze", "virtualmachineinstances/unfreeze",
		"virtualmachineinstances/softreboot", "virtualmachineinstances/reset",
		"virtualmachineinstances/sev/setupsession", "virtualmachineinstances/sev/injectlaunchsecret",
		"virtualmachineinstances/evacuate/cancel",
	}
	vmGet    = []string{"virtualmachines/expand-spec", "virtualmachines/portforward"}
	vmUpdate = []string{
		"virtualmachines/start", "virtualmachines/stop", "virtualmachines/restart", "virtualmachines/addvolume",
		"virtualmachines/removevolume", "virtualmachines/memorydump", "virtualmachines/removememorydump",
		"virtualmachines/evacuate/cancel",
	}
	vms           = []string{"virtualmachines", "virtualmachineinstances", "virtualmachineinstancepresets", "virtualmachineinstancereplicasets"}
	snapshots     = []string{"virtualmachinesnapshots", "virtualmachinesnapshotcontents", "virtualmachinerestores"}
	backups       = []string{"virtualmachinebackups", "virtualmachinebackuptrackers"}
	instancetypes = []string{"virtualmachineinstancetypes", "virtualmachineclusterinstancetypes", "virtualmachinepreferences", "virtualmachineclusterpreferences"}
)

func rule(group string, resources []string, verbs ...string) rbacv1.PolicyRule {
	return rbacv1.PolicyRule{APIGroups: []string{group}, Resources: resources, Verbs: verbs}
}

func role(name string, labels map[string]string, rules ...rbacv1.PolicyRule) *rbacv1.ClusterRole {
	l := map[string]string{"kubevirt.io": "", "app.kubernetes.io/managed-by": "nodevirt"}
	for k, v := range labels {
		l[k] = v
	}
	return &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: l}, Rules: rules}
}

// writerRules are the rules admin and edit share; streams are the instance
// subresources they may get, verbs the verb set on the objects themselves.
func writerRules(streams, verbs []string) []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		rule(subresources, streams, "get"),
		rule(subresources, vmiUpdate, "update"),
		rule(subresources, vmGet, "get"),
		rule(subresources, vmUpdate, "update"),
		rule(subresources, []string{"expand-vm-spec"}, "update"),
		rule(core, vms, verbs...),
		rule(core, []string{"virtualmachineinstancemigrations"}, read...),
		rule(snapshot, snapshots, verbs...),
		rule(backup, backups, verbs...),
		rule(export, []string{"virtualmachineexports"}, verbs...),
		rule(clone, []string{"virtualmachineclones"}, verbs...),
		rule(instancetype, instancetypes, verbs...),
		rule(pool, []string{"virtualmachinepools"}, verbs...),
		rule(migrations, []string{"migrationpolicies"}, read...),
	}
}

// ClusterRoles returns KubeVirt's user-facing cluster roles.
func ClusterRoles() []*rbacv1.ClusterRole {
	// edit may not take VNC screenshots.
	edit := append(writerRules(without(vmiGet, "virtualmachineinstances/vnc/screenshot"), editAll),
		rule(core, []string{"kubevirts"}, "get", "list"))
	return []*rbacv1.ClusterRole{
		role(Default, map[string]string{"kubernetes.io/bootstrapping": "rbac-defaults"},
			rule(core, []string{"kubevirts"}, "get", "list"),
			rule(subresources, []string{"version", "guestfs"}, "get", "list")),
		role(Admin, map[string]string{"rbac.authorization.k8s.io/aggregate-to-admin": "true"}, writerRules(vmiGet, all)...),
		role(Edit, map[string]string{"rbac.authorization.k8s.io/aggregate-to-edit": "true"}, edit...),
		role(View, map[string]string{"rbac.authorization.k8s.io/aggregate-to-view": "true"},
			rule(core, []string{"kubevirts"}, "get", "list"),
			rule(subresources, []string{
				"virtualmachines/expand-spec", "virtualmachineinstances/guestosinfo",
				"virtualmachineinstances/filesystemlist", "virtualmachineinstances/userlist",
				"virtualmachineinstances/sev/fetchcertchain", "virtualmachineinstances/sev/querylaunchmeasurement",
				"virtualmachines/objectgraph", "virtualmachineinstances/objectgraph",
			}, "get"),
			rule(subresources, []string{"expand-vm-spec"}, "update"),
			rule(core, append(append([]string(nil), vms...), "virtualmachineinstancemigrations"), read...),
			rule(snapshot, snapshots, read...),
			rule(backup, backups, read...),
			rule(export, []string{"virtualmachineexports"}, read...),
			rule(clone, []string{"virtualmachineclones"}, read...),
			rule(instancetype, instancetypes, read...),
			rule(pool, []string{"virtualmachinepools"}, read...),
			rule(migrations, []string{"migrationpolicies"}, read...)),
		role(Migrate, nil,
			rule(subresources, []string{"virtualmachines/migrate"}, "update"),
			rule(core, []string{"virtualmachineinstancemigrations"}, all...)),
	}
}

// ClusterRoleBindings returns the bindings KubeVirt installs with the roles:
// every authenticated user gets kubevirt.io:default.
func ClusterRoleBindings() []*rbacv1.ClusterRoleBinding {
	return []*rbacv1.ClusterRoleBinding{{
		ObjectMeta: metav1.ObjectMeta{Name: Default, Labels: map[string]string{"kubevirt.io": "", "app.kubernetes.io/managed-by": "nodevirt"}},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: Default},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.GroupKind, APIGroup: rbacv1.GroupName, Name: "system:authenticated"}},
	}}
}

func without(list []string, drop string) []string {
	var out []string
	for _, s := range list {
		if s != drop {
			out = append(out, s)
		}
	}
	return out
}

// Ensure creates the roles and bindings, or brings drifted ones back to
// KubeVirt's rules.
func Ensure(ctx context.Context, kube kubernetes.Interface) error {
	if err := ensureClusterRoles(ctx, kube, ClusterRoles()); err != nil {
		return err
	}
	return ensureClusterRoleBindings(ctx, kube, ClusterRoleBindings())
}

func labelsHave(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}

func merge(a, b map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}
