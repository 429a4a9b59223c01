package datavolume

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// TestUsableNode: a claim placed at once goes only to a node a pod without
// tolerations could go to: Ready, schedulable, untainted (an upload also
// needs the node's upload endpoint).
func TestUsableNode(t *testing.T) {
	ready := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue}
	node := func(mutate func(*corev1.Node)) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n",
			Annotations: map[string]string{importstate.NodeUploadEndpoint: "192.0.2.1:8447"}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{ready}}}
		if mutate != nil {
			mutate(n)
		}
		return n
	}
	cases := []struct {
		name   string
		node   *corev1.Node
		upload bool
		want   bool
	}{
		{"ready", node(nil), true, true},
		{"cordoned", node(func(n *corev1.Node) { n.Spec.Unschedulable = true }), false, false},
		{"not ready", node(func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionFalse }), false, false},
		{"unreachable", node(func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionUnknown }), false, false},
		{"NoSchedule taint", node(func(n *corev1.Node) {
			n.Spec.Taints = []corev1.Taint{{Key: "dedicated", Effect: corev1.TaintEffectNoSchedule}}
		}), false, false},
		{"NoExecute taint", node(func(n *corev1.Node) {
			n.Spec.Taints = []corev1.Taint{{Key: "node.kubernetes.io/unreachable", Effect: corev1.TaintEffectNoExecute}}
		}), false, false},
		{"PreferNoSchedule taint", node(func(n *corev1.Node) {
			n.Spec.Taints = []corev1.Taint{{Key: "soft", Effect: corev1.TaintEffectPreferNoSchedule}}
		}), false, true},
		{"upload without endpoint", node(func(n *corev1.Node) { n.Annotations = nil }), true, false},
		{"import without endpoint", node(func(n *corev1.Node) { n.Annotations = nil }), false, true},
	}
	for _, c := range cases {
		if got := usableNode(c.node, c.upload); got != c.want {
			t.Errorf("%s: usableNode = %v, want %v", c.name, got, c.want)
		}
	}
}
