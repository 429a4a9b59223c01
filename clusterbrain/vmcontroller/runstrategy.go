package vmcontroller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/fencing"
)

// runStrategy acts on the first pending state-change request, then makes
// the VMI match the run strategy.
func (c *Controller) runStrategy(ctx context.Context, st *state, log *slog.Logger) (time.Duration, error) {
	vm, vmi := st.vm, st.vmi
	final := vmi != nil && vmi.IsFinal()
	if reqs := vm.Status.StateChangeRequests; len(reqs) > 0 {
		r := reqs[0]
		switch r.Action {
		case kubevirtv1.StopRequest:
			if vmi != nil && (r.UID == nil || *r.UID == vmi.UID) {
				if vmi.DeletionTimestamp == nil {
					c.deleteVMI(ctx, vm, vmi, "stop requested")
					st.deleted = true
				}
				return 0, nil // the request is dropped once the VMI is gone
			}
			st.popped = 1
			vmi = nil
			if st.rs == kubevirtv1.RunStrategyAlways && len(reqs) == 1 {
				// A restart of an Always VM is a Stop alone: fall through
				// and start it again.
				break
			}
			return 0, nil
		case kubevirtv1.StartRequest:
			switch {
			case vmi == nil:
				after, err := c.start(ctx, st, log)
				if err == nil && st.created {
					st.popped = 1
				}
				return after, err
			case final:
				if vmi.DeletionTimestamp == nil {
					c.deleteVMI(ctx, vm, vmi, "start requested")
					st.deleted = true
				}
				return 0, nil
			default:
				st.popped = 1 // already running
				return 0, nil
			}
		default:
			st.popped = 1 // unknown action: drop it
		}
	}

	switch st.rs {
	case kubevirtv1.RunStrategyHalted:
		if vmi != nil && vmi.DeletionTimestamp == nil {
			c.deleteVMI(ctx, vm, vmi, "run strategy Halted")
			st.deleted = true
		}
	case kubevirtv1.RunStrategyAlways, kubevirtv1.RunStrategyRerunOnFailure:
		if vmi == nil {
			return c.start(ctx, st, log)
		}
		failed := vmi.Status.Phase == kubevirtv1.Failed
		if vmi.Status.Phase == kubevirtv1.Running {
			vm.Status.StartFailure = nil
			c.failures.Delete(vm.UID)
		}
		if final && (st.rs == kubevirtv1.RunStrategyAlways || failed) && vmi.DeletionTimestamp == nil {
			// A lost node is not the VM's failure: it restarts elsewhere
			// without the crash-loop back-off.
			if failed && vmi.Status.Reason != fencing.ReasonNodeUnreachable {
				c.recordFailure(st)
			}
			c.deleteVMI(ctx, vm, vmi, "restarting after the VMI ended")
			st.deleted = true
		}
	case kubevirtv1.RunStrategyOnce:
		if vmi == nil && !vm.Status.Created && vm.Status.PrintableStatus == "" {
			return c.start(ctx, st, log)
		}
	case kubevirtv1.RunStrategyManual:
		if vmi != nil && vmi.Status.Phase == kubevirtv1.Running {
			vm.Status.StartFailure = nil
			c.failures.Delete(vm.UID)
		}
	}
	return 0, nil
}

// recordFailure counts a failed VMI once and sets the retry time.
func (c *Controller) recordFailure(st *state) {
	vm, vmi := st.vm, st.vmi
	f := c.startFailure(vm)
	if f != nil && f.LastFailedVMIUID == vmi.UID {
		return
	}
	n := 1
	if f != nil {
		n = f.ConsecutiveFailCount + 1
	}
	delay := c.cfg.BackoffBase << (n - 1)
	if delay > c.cfg.BackoffMax || delay <= 0 {
		delay = c.cfg.BackoffMax
	}
	retry := metav1.NewTime(c.now().Add(delay))
	vm.Status.StartFailure = &kubevirtv1.VirtualMachineStartFailure{ConsecutiveFailCount: n, LastFailedVMIUID: vmi.UID, RetryAfterTimestamp: &retry}
	c.failures.Store(vm.UID, vm.Status.StartFailure.DeepCopy())
	c.recorder.Eventf(vm, corev1.EventTypeWarning, "FailedStart", "VMI %s failed; starting again in %s (failure %d)", vmi.Name, delay, n)
}

// start creates the VMI unless volumes or back-off hold it.
func (c *Controller) start(ctx context.Context, st *state, log *slog.Logger) (time.Duration, error) {
	vm := st.vm
	st.wantsStart = true
	if !st.dvsReady {
		return 0, nil // DataVolume changes bring us back
	}
	if f := c.startFailure(vm); f != nil && f.RetryAfterTimestamp != nil {
		vm.Status.StartFailure = f
		if wait := f.RetryAfterTimestamp.Sub(c.now()); wait > 0 {
			st.backoff = true
			return wait, nil
		}
	}
	spec, annotations, err := c.expand(ctx, vm)
	if err != nil {
		c.recorder.Eventf(vm, corev1.EventTypeWarning, "FailedCreate", "Error creating VMI: %v", err)
		var agg utilerrors.Aggregate
		if errors.As(err, &agg) {
			return 0, permanent{err} // the VM must change first
		}
		return 0, err
	}
	t := vm.Spec.Template
	vmi := &kubevirtv1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: vm.Name, Namespace: vm.Namespace, Labels: map[string]string{}, Annotations: map[string]string{},
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(vm, kubevirtv1.VirtualMachineGroupVersionKind)}},
		Spec: *spec,
	}
	for k, v := range t.ObjectMeta.Labels {
		vmi.Labels[k] = v
	}
	for k, v := range annotations {
		vmi.Annotations[k] = v
	}
	for k, v := range t.ObjectMeta.Annotations {
		vmi.Annotations[k] = v
	}
	vmi.Annotations[annVMGeneration] = fmt.Sprint(vm.Generation)
	vmi.Annotations[AnnStartSpec] = startDigest(vm)
	// The VMI webhooks are not called for the brain's own creates (their
	// match condition leaves its user out): they are applied here, so the
	// VMI is what they would have made of it and a spec they refuse is
	// refused with their message, reported as a refused create is.
	if err := admission.AdmitVMICreate(vmi, c.cfg.CPUModels.Get(), c.cfg.MemoryOvercommit.Get(), c.cfg.Rollout.Get()); err != nil {
		c.recorder.Eventf(vm, corev1.EventTypeWarning, "FailedCreate", "Error creating VMI: %v", err)
		return 0, fmt.Errorf("create vmi: %w", err)
	}
	reserved := ""
	if c.cfg.Placer != nil {
		if reserved = c.cfg.Placer.Reserve(vmi); reserved != "" {
			vmi.Labels[kubevirtv1.NodeNameLabel] = reserved
		}
	}
	if _, err := c.cfg.Virt.VMIs.Create(ctx, vmi); err != nil {
		if reserved != "" {
			c.cfg.Placer.Unreserve(vmi.Namespace, vmi.Name)
		}
		if apierrors.IsAlreadyExists(err) {
			return 0, nil // an older one is still going away
		}
		c.recorder.Eventf(vm, corev1.EventTypeWarning, "FailedCreate", "Error creating VMI: %v", err)
		return 0, fmt.Errorf("create vmi: %w", err)
	}
	st.created, st.wantsStart = true, false
	c.creating.Store(vm.Namespace+"/"+vm.Name, creation{vmUID: vm.UID, at: c.now()})
	c.recorder.Eventf(vm, corev1.EventTypeNormal, "SuccessfulCreate", "Started the virtual machine by creating the new virtual machine instance %s", vm.Name)
	log.Debug("vmi created")
	return 0, nil
}

func (c *Controller) deleteVMI(ctx context.Context, vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, why string) {
	uid := vmi.UID
	err := c.cfg.Virt.VMIs.Delete(ctx, vmi.Namespace, vmi.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		c.recorder.Eventf(vm, corev1.EventTypeWarning, "FailedDelete", "Error deleting VMI %s: %v", vmi.Name, err)
		return
	}
	c.recorder.Eventf(vm, corev1.EventTypeNormal, "SuccessfulDelete", "Stopped the virtual machine by deleting the virtual machine instance %s (%s)", vmi.UID, why)
}

// permanent marks an error a retry cannot fix; it is reported in the VM's
// conditions and the VM is looked at again when it changes.
type permanent struct{ error }

func (p permanent) Unwrap() error { return p.error }

// startFailure is the VM's latest start failure: its status, or what this
// controller recorded more recently than the cache shows.
func (c *Controller) startFailure(vm *kubevirtv1.VirtualMachine) *kubevirtv1.VirtualMachineStartFailure {
	f := vm.Status.StartFailure
	if v, ok := c.failures.Load(vm.UID); ok {
		mem := v.(*kubevirtv1.VirtualMachineStartFailure)
		// Equal counts: prefer ours, whose retry time has not been
		// truncated to the second by serialization.
		if f == nil || mem.ConsecutiveFailCount >= f.ConsecutiveFailCount {
			return mem.DeepCopy()
		}
	}
	return f
}
