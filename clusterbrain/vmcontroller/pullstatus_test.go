package vmcontroller

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// A failed containerDisk pull the node agent reports on the VMI's
// Synchronized condition shows as the VM's printableStatus, as KubeVirt
// shows a failed image pull, instead of Starting.
func TestFailedPullShowsOnPrintableStatus(t *testing.T) {
	e := setup(t)
	e.newVM("pull", nil)
	_, vmi := e.waitVM("pull", "vmi created", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	synchronized := func(reason string) {
		t.Helper()
		cur, err := e.virt.VMIs.Get(context.Background(), vmi.Namespace, vmi.Name)
		if err != nil {
			t.Fatal(err)
		}
		cur.Status.Phase = kubevirtv1.Scheduled
		cur.Status.NodeName = "node-1"
		cur.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstanceSynchronized,
			Status: corev1.ConditionFalse, Reason: reason, Message: `pull quay.io/nowhere/nothing:latest: not found`}}
		if _, err := e.virt.VMIs.UpdateStatus(context.Background(), cur); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range []kubevirtv1.VirtualMachinePrintableStatus{kubevirtv1.VirtualMachineStatusErrImagePull, kubevirtv1.VirtualMachineStatusImagePullBackOff} {
		synchronized(string(want))
		e.waitVM("pull", string(want), status(want))
	}
	// Another reason (a volume not there yet) is still Starting.
	synchronized("Waiting")
	e.waitVM("pull", "Starting again", status(kubevirtv1.VirtualMachineStatusStarting))
}
