package subresources

import (
	"context"
	"net/http"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/migration"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// TestEvacuateCancel: evacuate/cancel is refused while the node carries
// the drain taint, refused for another node than the one marked, and
// otherwise takes the VMI off the evacuation (evacuationNodeName and the
// EvictionRequested condition gone); with nothing marked it succeeds.
func TestEvacuateCancel(t *testing.T) {
	setup(t)
	ctx := context.Background()
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	c := adminIn(t, ns)
	kube := cp.Clientset(t)
	drained := ns + "-drained"
	drain := corev1.Taint{Key: migration.DefaultDrainTaintKey, Effect: corev1.TaintEffectNoSchedule}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: drained}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{drain}}}
	if _, err := kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kube.CoreV1().Nodes().Delete(context.Background(), drained, metav1.DeleteOptions{}) })

	vmi := newVMI(t, ns, "leaving", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceEvictionRequested)
	vmi.Status.EvacuationNodeName = drained
	vmi, err := env.virt.VMIs.UpdateStatus(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	cancel := &kubevirtv1.EvacuateCancelOptions{EvacuationNodeName: drained}
	wantStatus(t, "cancel on a draining node", c.VMI(ctx, vmi.Name, "evacuate/cancel", cancel), http.StatusBadRequest,
		`Node "`+drained+`" has NodeDrainTaintKey`)

	node, err = kube.CoreV1().Nodes().Get(ctx, drained, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Spec.Taints = nil
	if _, err := kube.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, "cancel naming another node", c.VMI(ctx, vmi.Name, "evacuate/cancel",
		&kubevirtv1.EvacuateCancelOptions{EvacuationNodeName: "elsewhere"}), http.StatusConflict, "not being evacuated from")
	wantStatus(t, "cancel without a body", c.VMI(ctx, vmi.Name, "evacuate/cancel", nil), http.StatusBadRequest, "No body")
	if err := c.VMI(ctx, vmi.Name, "evacuate/cancel", cancel); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	got, err := env.virt.VMIs.Get(ctx, ns, vmi.Name)
	if err != nil {
		t.Fatal(err)
	}
	if got.Status.EvacuationNodeName != "" {
		t.Errorf("evacuationNodeName %q after the cancel", got.Status.EvacuationNodeName)
	}
	for _, cond := range got.Status.Conditions {
		if cond.Type == kubevirtv1.VirtualMachineInstanceEvictionRequested {
			t.Errorf("EvictionRequested kept after the cancel: %+v", cond)
		}
	}
	if err := c.VMI(ctx, vmi.Name, "evacuate/cancel", cancel); err != nil {
		t.Errorf("a second cancel, nothing marked: %v", err)
	}
	wantStatus(t, "cancel of a missing vmi", c.VMI(ctx, "nope", "evacuate/cancel", cancel), http.StatusNotFound, "nope")
}
