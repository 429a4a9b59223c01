package vmcontroller

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// printableStatus says in one word what the VM is doing, as `kubectl get
// vm` shows it.
func (c *Controller) printableStatus(st *state) kubevirtv1.VirtualMachinePrintableStatus {
	vm, vmi := st.vm, st.vmi
	if vm.DeletionTimestamp != nil {
		return kubevirtv1.VirtualMachineStatusTerminating
	}
	if st.dvFailed != "" {
		return kubevirtv1.VirtualMachineStatusDataVolumeError
	}
	if vmi == nil || st.deleted {
		switch {
		case st.deleted && vmi != nil:
			return kubevirtv1.VirtualMachineStatusStopping
		case st.backoff:
			return kubevirtv1.VirtualMachineStatusCrashLoopBackOff
		case st.created:
			return kubevirtv1.VirtualMachineStatusStarting
		case st.wantsStart && !st.dvsReady:
			return kubevirtv1.VirtualMachineStatusProvisioning
		case st.wantsStart:
			return kubevirtv1.VirtualMachineStatusStarting
		}
		return kubevirtv1.VirtualMachineStatusStopped
	}
	if vmi.DeletionTimestamp != nil {
		return kubevirtv1.VirtualMachineStatusStopping
	}
	for _, cnd := range vmi.Status.Conditions {
		if string(cnd.Type) == string(corev1.PodScheduled) && cnd.Status == corev1.ConditionFalse && cnd.Reason == corev1.PodReasonUnschedulable {
			return kubevirtv1.VirtualMachineStatusUnschedulable
		}
	}
	switch vmi.Status.Phase {
	case "", kubevirtv1.Pending, kubevirtv1.Scheduling, kubevirtv1.Scheduled:
		if s := pullFailure(vmi); s != "" {
			return s
		}
		return kubevirtv1.VirtualMachineStatusStarting
	case kubevirtv1.Running:
		if condTrue(vmi, kubevirtv1.VirtualMachineInstancePaused) {
			return kubevirtv1.VirtualMachineStatusPaused
		}
		if vmi.Status.MigrationState != nil && !vmi.Status.MigrationState.Completed {
			return kubevirtv1.VirtualMachineStatusMigrating
		}
		return kubevirtv1.VirtualMachineStatusRunning
	case kubevirtv1.Succeeded, kubevirtv1.Failed:
		if st.backoff || (vm.Status.StartFailure != nil && vm.Status.StartFailure.LastFailedVMIUID == vmi.UID &&
			st.rs != kubevirtv1.RunStrategyManual && st.rs != kubevirtv1.RunStrategyOnce) {
			return kubevirtv1.VirtualMachineStatusCrashLoopBackOff
		}
		return kubevirtv1.VirtualMachineStatusStopped
	}
	return kubevirtv1.VirtualMachineStatusUnknown
}

// pullFailure is ErrImagePull or ImagePullBackOff when the node agent
// reports a failed containerDisk pull on the VMI's Synchronized condition,
// as KubeVirt shows a failed pull of the launcher pod's images.
func pullFailure(vmi *kubevirtv1.VirtualMachineInstance) kubevirtv1.VirtualMachinePrintableStatus {
	for _, c := range vmi.Status.Conditions {
		if c.Type != kubevirtv1.VirtualMachineInstanceSynchronized || c.Status != corev1.ConditionFalse {
			continue
		}
		switch s := kubevirtv1.VirtualMachinePrintableStatus(c.Reason); s {
		case kubevirtv1.VirtualMachineStatusErrImagePull, kubevirtv1.VirtualMachineStatusImagePullBackOff:
			return s
		}
	}
	return ""
}

func condTrue(vmi *kubevirtv1.VirtualMachineInstance, t kubevirtv1.VirtualMachineInstanceConditionType) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == t {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func setCondition(conds []kubevirtv1.VirtualMachineCondition, c kubevirtv1.VirtualMachineCondition) []kubevirtv1.VirtualMachineCondition {
	for i := range conds {
		if conds[i].Type == c.Type {
			if conds[i].Status == c.Status && conds[i].Reason == c.Reason && conds[i].Message == c.Message {
				return conds
			}
			if conds[i].Status == c.Status {
				c.LastTransitionTime = conds[i].LastTransitionTime
			}
			conds[i] = c
			return conds
		}
	}
	return append(conds, c)
}

func removeCondition(conds []kubevirtv1.VirtualMachineCondition, t kubevirtv1.VirtualMachineConditionType) []kubevirtv1.VirtualMachineCondition {
	out := conds[:0]
	for _, c := range conds {
		if c.Type != t {
			out = append(out, c)
		}
	}
	return out
}

// writeStatus computes the VM's status from st and writes it when it
// changed.
func (c *Controller) writeStatus(ctx context.Context, st *state) error {
	vm := st.vm
	s := &vm.Status
	vmi := st.vmi
	live := vmi != nil && !st.deleted
	s.Created = live || st.created
	s.Ready = live && vmi.DeletionTimestamp == nil && condTrue(vmi, kubevirtv1.VirtualMachineInstanceReady)
	s.PrintableStatus = c.printableStatus(st)
	s.RunStrategy = st.rs
	s.ObservedGeneration = vm.Generation
	s.DesiredGeneration = vm.Generation
	if st.popped > 0 && len(s.StateChangeRequests) >= st.popped {
		s.StateChangeRequests = s.StateChangeRequests[st.popped:]
	}
	if len(s.StateChangeRequests) == 0 {
		s.StateChangeRequests = nil
	}
	now := metav1.NewTime(c.now())
	ready := kubevirtv1.VirtualMachineCondition{Type: kubevirtv1.VirtualMachineReady, Status: corev1.ConditionFalse,
		Reason: "VMINotExists", Message: "VMI does not exist", LastProbeTime: now, LastTransitionTime: now}
	if live || st.created {
		// A VMI created in this sync exists: say so now rather than in a
		// second write once the cache shows it.
		ready.Reason, ready.Message = "VMINotReady", "VMI is not ready"
	}
	if live {
		if s.Ready {
			ready.Status, ready.Reason, ready.Message = corev1.ConditionTrue, "", ""
		}
		for _, cnd := range vmi.Status.Conditions {
			if cnd.Type == kubevirtv1.VirtualMachineInstanceReady && cnd.Status != corev1.ConditionTrue && cnd.Reason != "" {
				ready.Reason, ready.Message = cnd.Reason, cnd.Message
			}
		}
	}
	ready.LastProbeTime = metav1.Time{}
	s.Conditions = setCondition(s.Conditions, ready)
	if live && condTrue(vmi, kubevirtv1.VirtualMachineInstancePaused) {
		s.Conditions = setCondition(s.Conditions, kubevirtv1.VirtualMachineCondition{Type: kubevirtv1.VirtualMachinePaused,
			Status: corev1.ConditionTrue, Reason: "PausedByUser", Message: "VMI was paused by user", LastTransitionTime: now})
	} else {
		s.Conditions = removeCondition(s.Conditions, kubevirtv1.VirtualMachinePaused)
	}
	s.Conditions = restartCondition(s.Conditions, st, now)
	if st.failure != nil {
		reason := st.failureReason
		if reason == "" {
			reason = "FailedCreate"
		}
		s.Conditions = setCondition(s.Conditions, kubevirtv1.VirtualMachineCondition{Type: kubevirtv1.VirtualMachineFailure,
			Status: corev1.ConditionTrue, Reason: reason, Message: st.failure.Error(), LastTransitionTime: now})
	} else if st.dvFailed != "" {
		s.Conditions = setCondition(s.Conditions, kubevirtv1.VirtualMachineCondition{Type: kubevirtv1.VirtualMachineFailure,
			Status: corev1.ConditionTrue, Reason: "DataVolumeError", Message: st.dvFailed, LastTransitionTime: now})
	} else {
		s.Conditions = removeCondition(s.Conditions, kubevirtv1.VirtualMachineFailure)
	}
	if equality.Semantic.DeepEqual(st.orig.Status, vm.Status) {
		return nil
	}
	got, err := c.cfg.Virt.VMs.UpdateStatus(ctx, vm)
	if err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("update status: %w", err)
	}
	c.written.Store(vm.Namespace+"/"+vm.Name, writtenVM{from: st.orig.ResourceVersion, vm: got})
	return nil
}
