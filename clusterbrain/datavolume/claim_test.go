package datavolume

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
)

// TestVolumeFit: a claim placed at once goes only to a node an importer
// or upload pod of CDI could go to: Ready, schedulable, its NoSchedule and
// NoExecute taints tolerated by CDI's workload placement, within the
// class's allowedTopologies (an upload also needs the node's upload
// endpoint).
func TestVolumeFit(t *testing.T) {
	ready := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue}
	node := func(mutate func(*corev1.Node)) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n",
			Labels:      map[string]string{corev1.LabelHostname: "n", "rack": "r1"},
			Annotations: map[string]string{importstate.NodeUploadEndpoint: "192.0.2.1:8447"}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{ready}}}
		if mutate != nil {
			mutate(n)
		}
		return n
	}
	taint := func(key string, effect corev1.TaintEffect) func(*corev1.Node) {
		return func(n *corev1.Node) { n.Spec.Taints = []corev1.Taint{{Key: key, Effect: effect}} }
	}
	class := func(key, value string) *storagev1.StorageClass {
		return &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "local"}, AllowedTopologies: []corev1.TopologySelectorTerm{{
			MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{{Key: key, Values: []string{value}}}}}}
	}
	none := nodeplacement.Placement{Field: "cdi spec.workload"}
	tolerant := none
	tolerant.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "vms", Effect: corev1.TaintEffectNoSchedule}}
	selective := none
	selective.NodeSelector = map[string]string{"rack": "r2"}
	cases := []struct {
		name     string
		node     *corev1.Node
		sc       *storagev1.StorageClass
		workload nodeplacement.Placement
		upload   bool
		want     string
	}{
		{"ready", node(nil), nil, none, true, ""},
		{"cordoned", node(func(n *corev1.Node) { n.Spec.Unschedulable = true }), nil, none, false, "cordoned"},
		{"not ready", node(func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionFalse }), nil, none, false, "not ready"},
		{"unreachable", node(func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionUnknown }), nil, none, false, "not ready"},
		{"NoSchedule taint", node(taint("dedicated", corev1.TaintEffectNoSchedule)), nil, none, false,
			"taint dedicated:NoSchedule not tolerated by cdi spec.workload.tolerations"},
		{"NoSchedule taint tolerated by CDI's workload", node(func(n *corev1.Node) {
			n.Spec.Taints = []corev1.Taint{{Key: "dedicated", Value: "vms", Effect: corev1.TaintEffectNoSchedule}}
		}), nil, tolerant, true, ""},
		{"drain taint", node(taint("kubevirt.io/drain", corev1.TaintEffectNoSchedule)), nil, tolerant, false,
			"taint kubevirt.io/drain:NoSchedule not tolerated by cdi spec.workload.tolerations"},
		{"NoExecute taint", node(taint("node.kubernetes.io/out-of-service", corev1.TaintEffectNoExecute)), nil, none, false,
			"taint node.kubernetes.io/out-of-service:NoExecute not tolerated by cdi spec.workload.tolerations"},
		{"PreferNoSchedule taint", node(taint("soft", corev1.TaintEffectPreferNoSchedule)), nil, none, false, ""},
		{"CDI's workload selector", node(nil), nil, selective, false, "cdi spec.workload.nodeSelector rack=r2 does not match"},
		{"upload without endpoint", node(func(n *corev1.Node) { n.Annotations = nil }), nil, none, true, "no upload endpoint"},
		{"import without endpoint", node(func(n *corev1.Node) { n.Annotations = nil }), nil, none, false, ""},
		{"allowed by hostname", node(nil), class(corev1.LabelHostname, "n"), none, true, ""},
		{"another hostname", node(nil), class(corev1.LabelHostname, "m"), none, true, "not in storage class local's allowedTopologies"},
		{"allowed by a node label", node(nil), class("rack", "r1"), none, false, ""},
		{"another rack", node(nil), class("rack", "r2"), none, false, "not in storage class local's allowedTopologies"},
	}
	for _, c := range cases {
		if got := volumeFit(c.sc, c.workload, c.upload)(c.node); got != c.want {
			t.Errorf("%s: volumeFit = %q, want %q", c.name, got, c.want)
		}
	}
}
