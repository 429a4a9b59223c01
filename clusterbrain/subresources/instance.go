package subresources

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

func hasCondition(vmi *kubevirtv1.VirtualMachineInstance, t kubevirtv1.VirtualMachineInstanceConditionType) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == t && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// fetchVMI returns the VMI or a NotFound status.
func (s *Server) fetchVMI(ctx context.Context, ns, name string) (*kubevirtv1.VirtualMachineInstance, error) {
	vmi, err := s.getVMI(ctx, ns, name)
	if err != nil {
		return nil, err
	}
	if vmi == nil {
		return nil, apierrors.NewNotFound(vmiResource, name)
	}
	return vmi, nil
}

// forward validates the VMI and sends action to its nodeagent.
func (s *Server) forward(r *http.Request, req request, log *slog.Logger,
	validate func(*kubevirtv1.VirtualMachineInstance) error, dryRun bool) error {
	ctx := r.Context()
	vmi, err := s.fetchVMI(ctx, req.namespace, req.name)
	if err == nil {
		err = validate(vmi)
	}
	if err == nil && !vmi.IsRunning() && !vmi.IsScheduled() {
		err = apierrors.NewBadRequest(fmt.Sprintf("Unable to connect to VirtualMachineInstance because phase is %s instead of %s or %s",
			vmi.Status.Phase, kubevirtv1.Running, kubevirtv1.Scheduled))
	}
	if err != nil || dryRun {
		return err
	}
	if _, err := s.cfg.Node.Call(ctx, vmi, http.MethodPut, req.subresource, nil); err != nil {
		log.Error("nodeagent call", "node", vmi.Status.NodeName, "err", err)
		return err
	}
	log.Info("vmi "+req.subresource, "node", vmi.Status.NodeName)
	return nil
}

func isDryRun(d []string) bool { return len(d) > 0 && d[0] == metav1.DryRunAll }

func (s *Server) pauseVMI(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	opts := &kubevirtv1.PauseOptions{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	return s.forward(r, req, log, func(vmi *kubevirtv1.VirtualMachineInstance) error {
		if vmi.Status.Phase != kubevirtv1.Running {
			return apierrors.NewConflict(vmiResource, vmi.Name, errors.New(msgVMNotRunning))
		}
		if vmi.Spec.LivenessProbe != nil && vmi.Spec.LivenessProbe.GuestAgentPing == nil {
			return apierrors.NewForbidden(vmiResource, vmi.Name, errors.New("Pausing VMIs with a non-GuestAgentPing LivenessProbe is not supported"))
		}
		if hasCondition(vmi, kubevirtv1.VirtualMachineInstancePaused) {
			return apierrors.NewConflict(vmiResource, vmi.Name, errors.New("VMI is already paused"))
		}
		return nil
	}, isDryRun(opts.DryRun))
}

func (s *Server) unpauseVMI(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	opts := &kubevirtv1.UnpauseOptions{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	if vm, err := s.cfg.Virt.VMs.Get(r.Context(), req.namespace, req.name); err == nil && vm.Status.SnapshotInProgress != nil {
		return apierrors.NewConflict(vmResource, req.name, errors.New("VM snapshot is in progress"))
	}
	return s.forward(r, req, log, func(vmi *kubevirtv1.VirtualMachineInstance) error {
		if vmi.Status.Phase != kubevirtv1.Running {
			return apierrors.NewConflict(vmiResource, vmi.Name, errors.New(msgVMINotRunning))
		}
		if !hasCondition(vmi, kubevirtv1.VirtualMachineInstancePaused) {
			return apierrors.NewConflict(vmiResource, vmi.Name, errors.New(msgVMINotPaused))
		}
		return nil
	}, isDryRun(opts.DryRun))
}

func (s *Server) softRebootVMI(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	return s.forward(r, req, log, func(vmi *kubevirtv1.VirtualMachineInstance) error {
		if vmi.Status.Phase != kubevirtv1.Running {
			return apierrors.NewConflict(vmiResource, vmi.Name, errors.New(msgVMNotRunning))
		}
		if hasCondition(vmi, kubevirtv1.VirtualMachineInstancePaused) {
			return apierrors.NewConflict(vmiResource, vmi.Name, errors.New("VMI is paused"))
		}
		if !hasCondition(vmi, kubevirtv1.VirtualMachineInstanceAgentConnected) {
			if f := vmi.Spec.Domain.Features; f != nil && f.ACPI.Enabled != nil && !*f.ACPI.Enabled {
				return apierrors.NewConflict(vmiResource, vmi.Name, errors.New("VMI neither have the agent connected nor the ACPI feature enabled"))
			}
		}
		return nil
	}, false)
}

// resetVMI resets a running VMI like its reset button.
func (s *Server) resetVMI(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	return s.forward(r, req, log, func(vmi *kubevirtv1.VirtualMachineInstance) error {
		if !vmi.IsRunning() {
			return apierrors.NewConflict(vmiResource, vmi.Name, fmt.Errorf("Failed to reset non-running VMI with phase %s", vmi.Status.Phase))
		}
		return nil
	}, false)
}

// guestAgentGet reads guest-agent information from the nodeagent; a VMI
// without a connected agent is a conflict, as in KubeVirt.
func (s *Server) guestAgentGet(action string) handler {
	decoded := func() any {
		switch action {
		case "userlist":
			return &kubevirtv1.VirtualMachineInstanceGuestOSUserList{}
		case "filesystemlist":
			return &kubevirtv1.VirtualMachineInstanceFileSystemList{}
		default:
			return &kubevirtv1.VirtualMachineInstanceGuestAgentInfo{}
		}
	}
	return func(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
		ctx := r.Context()
		vmi, err := s.fetchVMI(ctx, req.namespace, req.name)
		if err != nil {
			return err
		}
		if err := agentReachable(vmi, msgVMINotRunning); err != nil {
			return err
		}
		data, err := s.cfg.Node.Call(ctx, vmi, http.MethodGet, action, nil)
		if err != nil {
			log.Error("nodeagent call", "node", vmi.Status.NodeName, "err", err)
			return err
		}
		v := decoded()
		if err := json.Unmarshal(data, v); err != nil {
			return apierrors.NewInternalError(fmt.Errorf("nodeagent %s answer: %w", action, err))
		}
		return httperr.WriteJSON(w, http.StatusOK, v)
	}
}
