package subresources

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// freezeVMI freezes a running VMI's file systems through its guest agent,
// KubeVirt's freeze subresource: the body (FreezeUnfreezeTimeout) says
// when the node thaws the guest by itself (0: never); unfreeze thaws it
// earlier. The node agent's freeze is the one online snapshots use.
func (s *Server) freezeVMI(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	opts := &kubevirtv1.FreezeUnfreezeTimeout{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	switch {
	case opts.UnfreezeTimeout == nil:
		return apierrors.NewBadRequest("FreezeUnfreezeTimeout requires unfreezeTimeout to be set")
	case opts.UnfreezeTimeout.Duration < 0:
		return apierrors.NewBadRequest("unfreezeTimeout must not be negative")
	}
	vmi, err := s.fetchVMI(r.Context(), req.namespace, req.name)
	if err != nil {
		return err
	}
	if err := agentReachable(vmi, msgVMNotRunning); err != nil {
		return err
	}
	body, err := json.Marshal(opts)
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	if _, err := s.cfg.Node.Call(r.Context(), vmi, http.MethodPut, "freeze", body); err != nil {
		log.Error("nodeagent call", "node", vmi.Status.NodeName, "err", err)
		return err
	}
	log.Info("vmi frozen", "node", vmi.Status.NodeName, "unfreezeTimeout", opts.UnfreezeTimeout.Duration)
	return nil
}

// unfreezeVMI thaws a running VMI's file systems; thawing a guest that is
// not frozen succeeds.
func (s *Server) unfreezeVMI(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	return s.forward(r, req, log, func(vmi *kubevirtv1.VirtualMachineInstance) error {
		return agentReachable(vmi, msgVMINotRunning)
	}, false)
}

// agentReachable refuses (409) a VMI that is not Running, answering
// notRunning, or whose guest agent is not connected.
func agentReachable(vmi *kubevirtv1.VirtualMachineInstance, notRunning string) error {
	if vmi.Status.Phase != kubevirtv1.Running {
		return apierrors.NewConflict(vmiResource, vmi.Name, errors.New(notRunning))
	}
	if !hasCondition(vmi, kubevirtv1.VirtualMachineInstanceAgentConnected) {
		return apierrors.NewConflict(vmiResource, vmi.Name, errors.New(msgNoGuestAgent))
	}
	return nil
}
