package subresources

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/migration"
)

// evacuateCancelVMI answers PUT virtualmachineinstances/{name}/evacuate/cancel.
func (s *Server) evacuateCancelVMI(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	vmi, err := s.fetchVMI(r.Context(), req.namespace, req.name)
	if err != nil {
		return err
	}
	return s.evacuateCancel(w, r, vmi, log)
}

// evacuateCancelVM answers PUT virtualmachines/{name}/evacuate/cancel, for
// the VM's VMI.
func (s *Server) evacuateCancelVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	vmi, err := s.vmiOfVM(r.Context(), req.namespace, req.name)
	if err != nil {
		return err
	}
	return s.evacuateCancel(w, r, vmi, log)
}

// evacuateCancel takes a VMI off the evacuation of its node as virt-api
// does: refused while that node still carries the drain taint (the
// evacuation would only start again), nothing to do when none is marked,
// otherwise status.evacuationNodeName is removed, if it still names the
// body's node, with the EvictionRequested condition that follows it. An
// evacuation migration already under way is not stopped (delete it).
func (s *Server) evacuateCancel(w http.ResponseWriter, r *http.Request, vmi *kubevirtv1.VirtualMachineInstance, log *slog.Logger) error {
	ctx := r.Context()
	if err := s.refuseWhileDraining(ctx, vmi); err != nil {
		return err
	}
	if vmi.Status.EvacuationNodeName == "" {
		w.WriteHeader(http.StatusOK)
		return nil
	}
	if r.Body == nil || r.ContentLength == 0 {
		return apierrors.NewBadRequest("No body")
	}
	opts := &kubevirtv1.EvacuateCancelOptions{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	patch := []patchOp{
		{Op: "test", Path: "/status/evacuationNodeName", Value: opts.EvacuationNodeName},
		{Op: "remove", Path: "/status/evacuationNodeName"},
	}
	if i := slices.IndexFunc(vmi.Status.Conditions, func(c kubevirtv1.VirtualMachineInstanceCondition) bool {
		return c.Type == kubevirtv1.VirtualMachineInstanceEvictionRequested
	}); i >= 0 {
		patch = append(patch, patchOp{Op: "test", Path: fmt.Sprintf("/status/conditions/%d/type", i), Value: string(kubevirtv1.VirtualMachineInstanceEvictionRequested)},
			patchOp{Op: "remove", Path: fmt.Sprintf("/status/conditions/%d", i)})
	}
	data, err := json.Marshal(patch)
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	if _, err := s.cfg.Virt.VMIs.Patch(ctx, vmi.Namespace, vmi.Name, types.JSONPatchType, data,
		metav1.PatchOptions{DryRun: opts.DryRun}, "status"); err != nil {
		if apierrors.IsInvalid(err) || apierrors.IsConflict(err) || apierrors.IsBadRequest(err) {
			return apierrors.NewConflict(vmiResource, vmi.Name, fmt.Errorf("the VMI is not being evacuated from %q: %w", opts.EvacuationNodeName, err))
		}
		return apierrors.NewInternalError(err)
	}
	log.Info("evacuation cancelled", "node", opts.EvacuationNodeName)
	w.WriteHeader(http.StatusOK)
	return nil
}

// refuseWhileDraining answers 400 when the node the VMI is evacuated from
// (else the node it runs on) has the cluster's drain taint.
func (s *Server) refuseWhileDraining(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	kvs, err := s.cfg.Virt.KubeVirts.List(ctx, metav1.NamespaceAll, metav1.ListOptions{})
	if err != nil {
		return apierrors.NewInternalError(fmt.Errorf("read the KubeVirt CR: %w", err))
	}
	key := migration.DrainTaintKey(kvs)
	name := vmi.Status.EvacuationNodeName
	if name == "" {
		name = vmi.Status.NodeName
	}
	if name == "" {
		return nil
	}
	node, err := s.cfg.Kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	taint := corev1.Taint{Key: key, Effect: corev1.TaintEffectNoSchedule}
	for _, t := range node.Spec.Taints {
		if t.MatchTaint(&taint) {
			return apierrors.NewBadRequest(fmt.Sprintf("Node %q has NodeDrainTaintKey %q", node.Name, taint.ToString()))
		}
	}
	return nil
}
