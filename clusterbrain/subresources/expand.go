package subresources

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"

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

// expand writes the referenced instancetype's CPU and memory into the VM's
// template and drops the reference. Preferences are not expanded yet: such
// a VM is refused with a clear error rather than half expanded.
func (s *Server) expand(ctx context.Context, vm *kubevirtv1.VirtualMachine) error {
	if vm.Spec.Preference != nil {
		return apierrors.NewBadRequest("expanding preferences is not supported by nodevirt yet")
	}
	m := vm.Spec.Instancetype
	if m == nil {
		return nil
	}
	if vm.Spec.Template == nil {
		return apierrors.NewBadRequest("VM has no template to expand into")
	}
	var spec instancetypev1beta1.VirtualMachineInstancetypeSpec
	switch strings.ToLower(m.Kind) {
	case "", "virtualmachineclusterinstancetype", "virtualmachineclusterinstancetypes":
		it, err := s.cfg.Virt.ClusterInstancetypes.Get(ctx, "", m.Name)
		if err != nil {
			return expandErr(m.Name, err)
		}
		spec = it.Spec
	case "virtualmachineinstancetype", "virtualmachineinstancetypes":
		it, err := s.cfg.Virt.Instancetypes.Get(ctx, vm.Namespace, m.Name)
		if err != nil {
			return expandErr(m.Name, err)
		}
		spec = it.Spec
	default:
		return apierrors.NewBadRequest(fmt.Sprintf("got unexpected kind in InstancetypeMatcher: %s", m.Kind))
	}
	d := &vm.Spec.Template.Spec.Domain
	if d.CPU != nil && (d.CPU.Sockets != 0 || d.CPU.Cores != 0 || d.CPU.Threads != 0) {
		return apierrors.NewConflict(vmResource, vm.Name, errors.New("VM field spec.template.spec.domain.cpu conflicts with selected instance type"))
	}
	if d.Memory != nil && d.Memory.Guest != nil {
		return apierrors.NewConflict(vmResource, vm.Name, errors.New("VM field spec.template.spec.domain.memory.guest conflicts with selected instance type"))
	}
	if d.CPU == nil {
		d.CPU = &kubevirtv1.CPU{}
	}
	// PreferSockets, the default topology: one core and thread per socket.
	d.CPU.Sockets, d.CPU.Cores, d.CPU.Threads = spec.CPU.Guest, 1, 1
	if spec.CPU.Model != nil {
		d.CPU.Model = *spec.CPU.Model
	}
	if spec.CPU.DedicatedCPUPlacement != nil {
		d.CPU.DedicatedCPUPlacement = *spec.CPU.DedicatedCPUPlacement
	}
	if d.Memory == nil {
		d.Memory = &kubevirtv1.Memory{}
	}
	guest := spec.Memory.Guest.DeepCopy()
	d.Memory.Guest = &guest
	if spec.Memory.Hugepages != nil {
		d.Memory.Hugepages = spec.Memory.Hugepages.DeepCopy()
	}
	vm.Spec.Instancetype = nil
	return nil
}

func expandErr(name string, err error) error {
	if apierrors.IsNotFound(err) {
		return apierrors.NewNotFound(instancetypev1beta1.Resource("virtualmachineinstancetype"), name)
	}
	return apierrors.NewInternalError(err)
}
