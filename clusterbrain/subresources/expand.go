package subresources

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/instancetypes/expansion"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// expandVMSpec answers virtualmachines/{name}/expand-spec.
func (s *Server) expandVMSpec(w http.ResponseWriter, r *http.Request, req request, _ *slog.Logger) error {
	vm, err := s.getVM(r.Context(), req.namespace, req.name)
	if err == nil {
		err = s.expand(r.Context(), vm)
	}
	if err != nil {
		return err
	}
	return httperr.WriteJSON(w, http.StatusOK, vm)
}

// expandSpecBody answers PUT expand-vm-spec with the VM of the body.
func (s *Server) expandSpecBody(w http.ResponseWriter, r *http.Request, req request, _ *slog.Logger) error {
	vm := &kubevirtv1.VirtualMachine{}
	if err := decodeBody(r, vm); err != nil {
		return err
	}
	if vm.Namespace == "" {
		vm.Namespace = req.namespace
	}
	if vm.Namespace != req.namespace {
		return apierrors.NewBadRequest(fmt.Sprintf("VM namespace must be empty or %s", req.namespace))
	}
	if err := s.expand(r.Context(), vm); err != nil {
		return err
	}
	return httperr.WriteJSON(w, http.StatusOK, vm)
}

// expand writes the VM's instance type and preference into its template
// by the rule the VM controller starts VMs by (expansion.Apply) and drops
// the references. A reference with a stored revision is expanded from it,
// as the VM controller does; one without, from the live object.
func (s *Server) expand(ctx context.Context, vm *kubevirtv1.VirtualMachine) error {
	if vm.Spec.Instancetype == nil && vm.Spec.Preference == nil {
		return nil
	}
	if vm.Spec.Template == nil {
		return apierrors.NewBadRequest("VM has no template to expand into")
	}
	it, err := s.instancetypeSpec(ctx, vm.Namespace, vm.Spec.Instancetype)
	if err != nil {
		return err
	}
	pref, err := s.preferenceSpec(ctx, vm.Namespace, vm.Spec.Preference)
	if err != nil {
		return err
	}
	if _, errs := expansion.Apply(field.NewPath("spec", "template", "spec"), &vm.Spec.Template.Spec, it, pref); len(errs) > 0 {
		msgs := make([]string, 0, len(errs))
		for _, e := range errs {
			if e.Detail == expansion.ConflictMsg {
				msgs = append(msgs, fmt.Sprintf("VM field %s conflicts with selected instance type", e.Field))
			} else {
				msgs = append(msgs, e.Error())
			}
		}
		return apierrors.NewConflict(vmResource, vm.Name, errors.New(strings.Join(msgs, "; ")))
	}
	vm.Spec.Instancetype, vm.Spec.Preference = nil, nil
	return nil
}

// instancetypeSpec returns the spec m names, nil for no matcher.
func (s *Server) instancetypeSpec(ctx context.Context, ns string, m *kubevirtv1.InstancetypeMatcher) (*instancetypev1beta1.VirtualMachineInstancetypeSpec, error) {
	resource := instancetypev1beta1.Resource("virtualmachineinstancetype")
	switch {
	case m == nil:
		return nil, nil
	case m.RevisionName != "":
		return revisionSpec[instancetypev1beta1.VirtualMachineInstancetypeSpec](ctx, s, ns, m.RevisionName)
	}
	switch expansion.InstancetypeScope(m.Kind) {
	case expansion.Cluster:
		it, err := s.cfg.Virt.ClusterInstancetypes.Get(ctx, "", m.Name)
		if err != nil {
			return nil, lookupErr(resource, m.Name, err)
		}
		return &it.Spec, nil
	case expansion.Namespaced:
		it, err := s.cfg.Virt.Instancetypes.Get(ctx, ns, m.Name)
		if err != nil {
			return nil, lookupErr(resource, m.Name, err)
		}
		return &it.Spec, nil
	}
	return nil, apierrors.NewBadRequest(fmt.Sprintf("got unexpected kind in InstancetypeMatcher: %s", m.Kind))
}

// preferenceSpec returns the spec m names, nil for no matcher.
func (s *Server) preferenceSpec(ctx context.Context, ns string, m *kubevirtv1.PreferenceMatcher) (*instancetypev1beta1.VirtualMachinePreferenceSpec, error) {
	resource := instancetypev1beta1.Resource("virtualmachinepreference")
	switch {
	case m == nil:
		return nil, nil
	case m.RevisionName != "":
		return revisionSpec[instancetypev1beta1.VirtualMachinePreferenceSpec](ctx, s, ns, m.RevisionName)
	}
	switch expansion.PreferenceScope(m.Kind) {
	case expansion.Cluster:
		p, err := s.cfg.Virt.ClusterPreferences.Get(ctx, "", m.Name)
		if err != nil {
			return nil, lookupErr(resource, m.Name, err)
		}
		return &p.Spec, nil
	case expansion.Namespaced:
		p, err := s.cfg.Virt.Preferences.Get(ctx, ns, m.Name)
		if err != nil {
			return nil, lookupErr(resource, m.Name, err)
		}
		return &p.Spec, nil
	}
	return nil, apierrors.NewBadRequest(fmt.Sprintf("got unexpected kind in PreferenceMatcher: %s", m.Kind))
}

// revisionSpec reads a spec the VM controller stored in a ControllerRevision.
func revisionSpec[S any](ctx context.Context, s *Server, ns, name string) (*S, error) {
	cr, err := s.cfg.Kube.AppsV1().ControllerRevisions(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, lookupErr(appsv1.Resource("controllerrevision"), name, err)
	}
	spec, err := expansion.RevisionSpec[S](cr.Data.Raw)
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("decode controllerrevision %s: %w", name, err))
	}
	return spec, nil
}

// lookupErr is a NotFound of resource/name, or an internal error.
func lookupErr(resource schema.GroupResource, name string, err error) error {
	if apierrors.IsNotFound(err) {
		return apierrors.NewNotFound(resource, name)
	}
	return apierrors.NewInternalError(err)
}
