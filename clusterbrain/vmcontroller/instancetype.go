package vmcontroller

import (
	"context"
	"encoding/json"
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/instancetypes/expansion"
)

// fetched is an instance type or preference read from the API, ready to
// be frozen into a ControllerRevision.
type fetched struct {
	name       string
	uid        types.UID
	generation int64
	object     runtime.Object // with TypeMeta set
}

func (c *Controller) fetchInstancetype(ctx context.Context, ns string, m *kubevirtv1.InstancetypeMatcher) (fetched, error) {
	gv := instancetypev1beta1.SchemeGroupVersion.String()
	switch expansion.InstancetypeScope(m.Kind) {
	case expansion.Cluster:
		it, err := c.cfg.Virt.ClusterInstancetypes.Get(ctx, "", m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachineclusterinstancetype %s: %w", m.Name, err)
		}
		it.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachineClusterInstancetype"}
		return fetched{it.Name, it.UID, it.Generation, it}, nil
	case expansion.Namespaced:
		it, err := c.cfg.Virt.Instancetypes.Get(ctx, ns, m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachineinstancetype %s: %w", m.Name, err)
		}
		it.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachineInstancetype"}
		return fetched{it.Name, it.UID, it.Generation, it}, nil
	}
	return fetched{}, fmt.Errorf("unknown instancetype kind %q", m.Kind)
}

func (c *Controller) fetchPreference(ctx context.Context, ns string, m *kubevirtv1.PreferenceMatcher) (fetched, error) {
	gv := instancetypev1beta1.SchemeGroupVersion.String()
	switch expansion.PreferenceScope(m.Kind) {
	case expansion.Cluster:
		p, err := c.cfg.Virt.ClusterPreferences.Get(ctx, "", m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachineclusterpreference %s: %w", m.Name, err)
		}
		p.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachineClusterPreference"}
		return fetched{p.Name, p.UID, p.Generation, p}, nil
	case expansion.Namespaced:
		p, err := c.cfg.Virt.Preferences.Get(ctx, ns, m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachinepreference %s: %w", m.Name, err)
		}
		p.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachinePreference"}
		return fetched{p.Name, p.UID, p.Generation, p}, nil
	}
	return fetched{}, fmt.Errorf("unknown preference kind %q", m.Kind)
}

// missingRef is an instance type or preference the VM names that does not
// exist (yet); reason is KubeVirt's Failure condition reason for it.
type missingRef struct {
	reason string
	err    error
}

func (m missingRef) Error() string { return m.err.Error() }
func (m missingRef) Unwrap() error { return m.err }

// missing marks a not-found err with reason; other errors pass unchanged.
func missing(reason string, err error) error {
	if apierrors.IsNotFound(err) {
		return missingRef{reason: reason, err: err}
	}
	return err
}

// storeRevision freezes f into a ControllerRevision owned by vm, named as
// KubeVirt names it (<vm>-<object>-<uid>-<generation>), and returns its name.
func (c *Controller) storeRevision(ctx context.Context, vm *kubevirtv1.VirtualMachine, f fetched) (string, error) {
	data, err := json.Marshal(f.object)
	if err != nil {
		return "", err
	}
	name := fmt.Sprintf("%s-%s-%s-%d", vm.Name, f.name, f.uid, f.generation)
	cr := &appsv1.ControllerRevision{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: vm.Namespace,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(vm, kubevirtv1.VirtualMachineGroupVersionKind)},
			Labels:          map[string]string{"instancetype.kubevirt.io/object-kind": f.object.GetObjectKind().GroupVersionKind().Kind, "instancetype.kubevirt.io/object-name": f.name}},
		Data:     runtime.RawExtension{Raw: data},
		Revision: f.generation,
	}
	_, err = c.cfg.Kube.AppsV1().ControllerRevisions(vm.Namespace).Create(ctx, cr, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("store revision %s: %w", name, err)
	}
	return name, nil
}

// ensureRevisions stores the instance type and preference of vm and
// records their revision names in its spec, as KubeVirt does; later edits
// of the type then no longer change the VM. It reports whether the VM was
// updated (a new sync follows).
func (c *Controller) ensureRevisions(ctx context.Context, vm *kubevirtv1.VirtualMachine) (bool, error) {
	var patch []map[string]any
	if m := vm.Spec.Instancetype; m != nil && m.RevisionName == "" {
		f, err := c.fetchInstancetype(ctx, vm.Namespace, m)
		if err != nil {
			return false, missing("FailedFindInstancetype", err)
		}
		name, err := c.storeRevision(ctx, vm, f)
		if err != nil {
			return false, err
		}
		patch = append(patch, map[string]any{"op": "add", "path": "/spec/instancetype/revisionName", "value": name})
	}
	if m := vm.Spec.Preference; m != nil && m.RevisionName == "" {
		f, err := c.fetchPreference(ctx, vm.Namespace, m)
		if err != nil {
			return false, missing("FailedFindPreference", err)
		}
		name, err := c.storeRevision(ctx, vm, f)
		if err != nil {
			return false, err
		}
		patch = append(patch, map[string]any{"op": "add", "path": "/spec/preference/revisionName", "value": name})
	}
	if len(patch) == 0 {
		return false, nil
	}
	patch = append([]map[string]any{{"op": "test", "path": "/metadata/resourceVersion", "value": vm.ResourceVersion}}, patch...)
	data, _ := json.Marshal(patch)
	if _, err := c.cfg.Virt.VMs.Patch(ctx, vm.Namespace, vm.Name, types.JSONPatchType, data, metav1.PatchOptions{}); err != nil {
		return false, fmt.Errorf("record revision names: %w", err)
	}
	return true, nil
}

func loadRevision[S any](ctx context.Context, c *Controller, ns, name string) (*S, error) {
	cr, err := c.cfg.Kube.AppsV1().ControllerRevisions(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("controllerrevision %s: %w", name, err)
	}
	spec, err := expansion.RevisionSpec[S](cr.Data.Raw)
	if err != nil {
		return nil, fmt.Errorf("decode controllerrevision %s: %w", name, err)
	}
	return spec, nil
}

// expand returns the VMI spec of vm with its stored instance type and
// preference applied (expansion.Apply); conflicts are returned as field
// errors.
func (c *Controller) expand(ctx context.Context, vm *kubevirtv1.VirtualMachine) (*kubevirtv1.VirtualMachineInstanceSpec, map[string]string, error) {
	spec := vm.Spec.Template.Spec.DeepCopy()
	var pref *instancetypev1beta1.VirtualMachinePreferenceSpec
	if m := vm.Spec.Preference; m != nil {
		p, err := loadRevision[instancetypev1beta1.VirtualMachinePreferenceSpec](ctx, c, vm.Namespace, m.RevisionName)
		if err != nil {
			return nil, nil, err
		}
		pref = p
	}
	var it *instancetypev1beta1.VirtualMachineInstancetypeSpec
	if m := vm.Spec.Instancetype; m != nil {
		i, err := loadRevision[instancetypev1beta1.VirtualMachineInstancetypeSpec](ctx, c, vm.Namespace, m.RevisionName)
		if err != nil {
			return nil, nil, err
		}
		it = i
	}
	annotations, errs := expansion.Apply(field.NewPath("spec", "template", "spec"), spec, it, pref)
	if len(errs) > 0 {
		return nil, nil, errs.ToAggregate()
	}
	return spec, annotations, nil
}
