package scheduler

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestVolumeConflictNamesTheVolume: a node that cannot reach a VMI's
// node-local volume says which volume holds the VMI elsewhere (what a VM
// whose node was lost waits with).
func TestVolumeConflictNamesTheVolume(t *testing.T) {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node2", Labels: map[string]string{SchedulableLabel: "true", KVMLabel: "true"}},
		Status: corev1.NodeStatus{Allocatable: corev1.ResourceList{
			corev1.ResourceCPU: resource.MustParse("4"), corev1.ResourceMemory: resource.MustParse("4Gi")}}}
	held := &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{
		{Key: "topology.hostpath.csi/node", Operator: corev1.NodeSelectorOpIn, Values: []string{"node1"}}}}}}
	req := &request{vmi: &kubevirtv1.VirtualMachineInstance{}, allowEmul: true,
		volumes: []*corev1.NodeSelector{held}, volumeOf: []string{"volume rootdisk: datavolume demo-disk"}}
	why := filter(req, newNodeState(n), nil)
	if len(why) != 1 || !strings.Contains(why[0], "rootdisk") || !strings.Contains(why[0], "demo-disk") {
		t.Fatalf("reason %q does not name the volume", why)
	}
	req = &request{vmi: &kubevirtv1.VirtualMachineInstance{}, allowEmul: true, pinned: "node1", pinnedBy: "volume data: persistentvolumeclaim d1"}
	if why := filter(req, newNodeState(n), nil); len(why) != 1 || !strings.Contains(why[0], "claim d1") {
		t.Fatalf("pinned: reason %q does not name the volume", why)
	}
}
