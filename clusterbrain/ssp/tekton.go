package ssp

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/yaml"

	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
	"github.com/nodevirt/nodevirt/clusterbrain/tekton/manifests"
)

// The pipeline objects the role deploys when an SSP's
// spec.featureGates.deployTektonTaskResources is on (HCO's
// deployTektonTaskResources): the Tasks with a ServiceAccount, ClusterRole
// and RoleBinding each ("<task>-task") in spec.tektonTasks.namespace (else
// spec.tektonPipelines.namespace, else the SSP's), and the example
// Pipelines in spec.tektonPipelines.namespace (else the SSP's). Turned
// off, they are removed. Tekton's CRDs are the cluster's: without
// tasks.tekton.dev (or pipelines.tekton.dev) the role reports it and
// deploys nothing of that kind.
const (
	TektonComponent = "tekton-tasks"
	labelComponent  = "app.kubernetes.io/component"
	TasksCRD        = "tasks.tekton.dev"
	PipelinesCRD    = "pipelines.tekton.dev"
)

var (
	TektonTasksGVR     = schema.GroupVersionResource{Group: "tekton.dev", Version: "v1", Resource: "tasks"}
	TektonPipelinesGVR = schema.GroupVersionResource{Group: "tekton.dev", Version: "v1", Resource: "pipelines"}
	crdGVR             = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	saGVR              = corev1.SchemeGroupVersion.WithResource("serviceaccounts")
	roleBindingGVR     = rbacv1.SchemeGroupVersion.WithResource("rolebindings")
	clusterRoleGVR     = rbacv1.SchemeGroupVersion.WithResource("clusterroles")
	tektonSelector     = templates.LabelManagedBy + "=" + templates.ManagedBy + "," + labelComponent + "=" + TektonComponent
)

// ErrNoTekton says a Tekton CRD the SSP needs is not installed.
var ErrNoTekton = errors.New("tekton is not installed")

type tektonObject struct {
	gvr schema.GroupVersionResource
	obj *unstructured.Unstructured
}

func (o tektonObject) key() string {
	return o.gvr.Resource + "/" + o.obj.GetNamespace() + "/" + o.obj.GetName()
}

// tektonNamespaces returns where an SSP's Tasks and Pipelines go, and
// whether it asks for them at all.
func tektonNamespaces(s *sspv1beta2.SSP) (tasks, pipelines string, on bool) {
	if s.DeletionTimestamp != nil || s.Spec.FeatureGates == nil || !s.Spec.FeatureGates.DeployTektonTaskResources {
		return "", "", false
	}
	pipelines = s.Namespace
	if p := s.Spec.TektonPipelines; p != nil && p.Namespace != "" {
		pipelines = p.Namespace
	}
	tasks = pipelines
	if t := s.Spec.TektonTasks; t != nil && t.Namespace != "" {
		tasks = t.Namespace
	}
	return tasks, pipelines, true
}

func toUnstructured(obj runtime.Object, apiVersion, kind string) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(apiVersion)
	u.SetKind(kind)
	return u, nil
}

func fromYAML(data []byte, ns string) (*unstructured.Unstructured, error) {
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal(data, &u.Object); err != nil {
		return nil, err
	}
	if ns != "" {
		u.SetNamespace(ns)
	}
	return u, nil
}

// tektonObjects renders what one SSP asks for.
func tektonObjects(tasksNS, pipelinesNS string) ([]tektonObject, error) {
	var out []tektonObject
	add := func(gvr schema.GroupVersionResource, u *unstructured.Unstructured) {
		l := u.GetLabels()
		if l == nil {
			l = map[string]string{}
		}
		l[templates.LabelManagedBy], l[labelComponent] = templates.ManagedBy, TektonComponent
		u.SetLabels(l)
		out = append(out, tektonObject{gvr, u})
	}
	files, err := manifests.Tasks()
	if err != nil {
		return nil, err
	}
	rules := manifests.TaskRules()
	names := make([]string, 0, len(files))
	for f := range files {
		names = append(names, f)
	}
	sort.Strings(names)
	for _, f := range names {
		task, err := fromYAML(files[f], tasksNS)
		if err != nil {
			return nil, fmt.Errorf("task %s: %w", f, err)
		}
		add(TektonTasksGVR, task)
		name := task.GetName() + "-task"
		cr, err := toUnstructured(&rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules[task.GetName()]}, "rbac.authorization.k8s.io/v1", "ClusterRole")
		if err != nil {
			return nil, err
		}
		add(clusterRoleGVR, cr)
		sa, err := toUnstructured(&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: tasksNS}}, "v1", "ServiceAccount")
		if err != nil {
			return nil, err
		}
		add(saGVR, sa)
		rb, err := toUnstructured(&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: tasksNS},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: name, Namespace: tasksNS}}}, "rbac.authorization.k8s.io/v1", "RoleBinding")
		if err != nil {
			return nil, err
		}
		add(roleBindingGVR, rb)
	}
	pipes, err := manifests.Pipelines()
	if err != nil {
		return nil, err
	}
	for f, data := range pipes {
		p, err := fromYAML([]byte(strings.ReplaceAll(string(data), manifests.TasksNamespacePlaceholder, tasksNS)), pipelinesNS)
		if err != nil {
			return nil, fmt.Errorf("pipeline %s: %w", f, err)
		}
		add(TektonPipelinesGVR, p)
	}
	return out, nil
}

func (r *Role) crdInstalled(ctx context.Context, name string) (bool, error) {
	_, err := r.cfg.Dynamic.Resource(crdGVR).Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil:
		return true, nil
	case apierrors.IsNotFound(err):
		return false, nil
	}
	return false, fmt.Errorf("crd %s: %w", name, err)
}

// syncTekton deploys every SSP's pipeline objects (server-side apply, so
// edits to what it sets are reverted) and removes the ones no SSP asks
// for; a missing Tekton CRD is an error naming it.
func (r *Role) syncTekton(ctx context.Context, ssps []*sspv1beta2.SSP) error {
	installed := map[schema.GroupVersionResource]bool{saGVR: true, roleBindingGVR: true, clusterRoleGVR: true}
	for gvr, crd := range map[schema.GroupVersionResource]string{TektonTasksGVR: TasksCRD, TektonPipelinesGVR: PipelinesCRD} {
		ok, err := r.crdInstalled(ctx, crd)
		if err != nil {
			return err
		}
		installed[gvr] = ok
	}
	want := map[string]tektonObject{}
	var errs []error
	for _, s := range ssps {
		tasksNS, pipelinesNS, on := tektonNamespaces(s)
		if !on {
			continue
		}
		for _, crd := range []struct {
			gvr  schema.GroupVersionResource
			name string
		}{{TektonTasksGVR, TasksCRD}, {TektonPipelinesGVR, PipelinesCRD}} {
			if !installed[crd.gvr] {
				errs = append(errs, fmt.Errorf("ssp %s/%s: deployTektonTaskResources: %w: CRD %s not found", s.Namespace, s.Name, ErrNoTekton, crd.name))
			}
		}
		for _, ns := range []string{tasksNS, pipelinesNS} {
			if err := r.ensureNamespace(ctx, ns); err != nil {
				return err
			}
		}
		objs, err := tektonObjects(tasksNS, pipelinesNS)
		if err != nil {
			return err
		}
		for _, o := range objs {
			want[o.key()] = o
		}
	}
	keys := make([]string, 0, len(want))
	for k := range want {
		keys = append(keys, k)
	}
	sort.Strings(keys) // ClusterRoles before the RoleBindings that bind them
	for _, k := range keys {
		o := want[k]
		if !installed[o.gvr] {
			continue
		}
		data, err := o.obj.MarshalJSON()
		if err != nil {
			return err
		}
		res := r.cfg.Dynamic.Resource(o.gvr).Namespace(o.obj.GetNamespace())
		force := true
		if _, err := res.Patch(ctx, o.obj.GetName(), "application/apply-patch+yaml", data,
			metav1.PatchOptions{FieldManager: templates.ManagedBy, Force: &force}); err != nil {
			errs = append(errs, fmt.Errorf("apply %s: %w", k, err))
		}
	}
	for _, gvr := range []schema.GroupVersionResource{TektonPipelinesGVR, TektonTasksGVR, roleBindingGVR, saGVR, clusterRoleGVR} {
		if !installed[gvr] {
			continue
		}
		have, err := r.cfg.Dynamic.Resource(gvr).List(ctx, metav1.ListOptions{LabelSelector: tektonSelector})
		if err != nil {
			errs = append(errs, fmt.Errorf("list %s: %w", gvr.Resource, err))
			continue
		}
		for _, h := range have.Items {
			k := gvr.Resource + "/" + h.GetNamespace() + "/" + h.GetName()
			if _, ok := want[k]; ok {
				continue
			}
			err := r.cfg.Dynamic.Resource(gvr).Namespace(h.GetNamespace()).Delete(ctx, h.GetName(), metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("remove %s: %w", k, err))
			} else {
				r.cfg.Log.Info("removed pipeline object", "resource", gvr.Resource, "namespace", h.GetNamespace(), "name", h.GetName())
			}
		}
	}
	return errors.Join(errs...)
}
