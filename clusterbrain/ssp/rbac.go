package ssp

import (
	"context"
	"fmt"
	"reflect"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
)

// Roles for templates: admin and edit may write templates and process
// them in their namespaces, view may read them (aggregated into the
// built-in roles), and every authenticated user may read the common
// templates, as on OpenShift.
const (
	roleTemplatesEdit   = "nodevirt.io:templates-edit"
	roleTemplatesView   = "nodevirt.io:templates-view"
	bindingCommonReader = "nodevirt.io:common-templates-readers"
)

func templateRoles() []*rbacv1.ClusterRole {
	labels := func(to ...string) map[string]string {
		l := map[string]string{templates.LabelManagedBy: templates.ManagedBy}
		for _, r := range to {
			l["rbac.authorization.k8s.io/aggregate-to-"+r] = "true"
		}
		return l
	}
	read := []string{"get", "list", "watch"}
	return []*rbacv1.ClusterRole{
		{ObjectMeta: metav1.ObjectMeta{Name: roleTemplatesEdit, Labels: labels("admin", "edit")}, Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{templates.Group}, Resources: []string{"templates"}, Verbs: append(read, "create", "update", "patch", "delete", "deletecollection")},
			{APIGroups: []string{templates.Group}, Resources: []string{"processedtemplates"}, Verbs: []string{"create"}},
		}},
		{ObjectMeta: metav1.ObjectMeta{Name: roleTemplatesView, Labels: labels("view")}, Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{templates.Group}, Resources: []string{"templates"}, Verbs: read},
		}},
	}
}

// ensureRoles installs the template roles (creating or correcting them).
func (r *Role) ensureRoles(ctx context.Context) error {
	crs := r.cfg.Kube.RbacV1().ClusterRoles()
	for _, want := range templateRoles() {
		cur, err := crs.Get(ctx, want.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			if _, err := crs.Create(ctx, want, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create clusterrole %s: %w", want.Name, err)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("get clusterrole %s: %w", want.Name, err)
		}
		if reflect.DeepEqual(cur.Rules, want.Rules) && subset(want.Labels, cur.Labels) {
			continue
		}
		cur.Rules, cur.Labels = want.Rules, mergeMaps(cur.Labels, want.Labels)
		if _, err := crs.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("update clusterrole %s: %w", want.Name, err)
		}
	}
	return nil
}

// ensureReaders lets every authenticated user read the templates of ns.
func (r *Role) ensureReaders(ctx context.Context, ns string) error {
	rbs := r.cfg.Kube.RbacV1().RoleBindings(ns)
	want := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: bindingCommonReader, Namespace: ns, Labels: map[string]string{templates.LabelManagedBy: templates.ManagedBy}},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: roleTemplatesView},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:authenticated"}},
	}
	cur, err := rbs.Get(ctx, want.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if _, err := rbs.Create(ctx, want, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create rolebinding %s/%s: %w", ns, want.Name, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("get rolebinding %s/%s: %w", ns, want.Name, err)
	}
	if reflect.DeepEqual(cur.Subjects, want.Subjects) && cur.RoleRef == want.RoleRef {
		return nil
	}
	// The role reference cannot change in place.
	if err := rbs.Delete(ctx, want.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("replace rolebinding %s/%s: %w", ns, want.Name, err)
	}
	if _, err := rbs.Create(ctx, want, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("replace rolebinding %s/%s: %w", ns, want.Name, err)
	}
	return nil
}
