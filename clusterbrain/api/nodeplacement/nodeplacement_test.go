package nodeplacement

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestFitMessage(t *testing.T) {
	got := FitMessage(3, map[string]int{"lacks bridge br1": 1, "insufficient memory": 2}, "")
	if want := "0/3 nodes are available: 2 insufficient memory, 1 lacks bridge br1."; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func node(name string, labels map[string]string, taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}, Spec: corev1.NodeSpec{Taints: taints}}
}

// TestTopologyAllows: allowedTopologies terms are ORed, the keys of one
// term ANDed, any node label may be a key; no terms allow every node.
func TestTopologyAllows(t *testing.T) {
	term := func(kv ...string) corev1.TopologySelectorTerm {
		var out corev1.TopologySelectorTerm
		for i := 0; i < len(kv); i += 2 {
			out.MatchLabelExpressions = append(out.MatchLabelExpressions, corev1.TopologySelectorLabelRequirement{Key: kv[i], Values: []string{kv[i+1]}})
		}
		return out
	}
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "local"}, AllowedTopologies: []corev1.TopologySelectorTerm{
		term(corev1.LabelHostname, "n1"),
		term("rack", "r2", "disk", "ssd"),
	}}
	for _, tc := range []struct {
		node *corev1.Node
		want bool
	}{
		{node("n1", map[string]string{corev1.LabelHostname: "n1"}), true},
		{node("n2", map[string]string{corev1.LabelHostname: "n2"}), false},
		{node("n3", map[string]string{corev1.LabelHostname: "n3", "rack": "r2", "disk": "ssd"}), true},
		{node("n4", map[string]string{corev1.LabelHostname: "n4", "rack": "r2"}), false},
		{node("n5", nil), false},
	} {
		if got := TopologyAllows(sc, tc.node); got != tc.want {
			t.Errorf("%s %v: allowed %v, want %v", tc.node.Name, tc.node.Labels, got, tc.want)
		}
	}
	if !TopologyAllows(&storagev1.StorageClass{}, node("any", nil)) || !TopologyAllows(nil, node("any", nil)) {
		t.Error("a class without allowedTopologies refused a node")
	}
}

// TestAdmits: selector, affinity and NoSchedule/NoExecute taints; the
// condition taints are skipped only for daemon-like workloads.
func TestAdmits(t *testing.T) {
	drain := corev1.Taint{Key: "kubevirt.io/drain", Effect: corev1.TaintEffectNoSchedule}
	soft := corev1.Taint{Key: "soft", Effect: corev1.TaintEffectPreferNoSchedule}
	unreachable := corev1.Taint{Key: "node.kubernetes.io/unreachable", Effect: corev1.TaintEffectNoExecute}
	labels := map[string]string{"zone": "a"}
	tolerateDrain := []corev1.Toleration{{Key: "kubevirt.io/drain", Operator: corev1.TolerationOpExists}}
	for _, tc := range []struct {
		name string
		p    Placement
		n    *corev1.Node
		want string
	}{
		{"nothing asked", Placement{Field: "f"}, node("n", labels, soft), ""},
		{"selector", Placement{Field: "f", NodeSelector: map[string]string{"zone": "b"}}, node("n", labels), "f.nodeSelector zone=b does not match"},
		{"affinity", Placement{Field: "f", Affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: corev1.NodeSelectorOpNotIn, Values: []string{"a"}}}}}}}}},
			node("n", labels), "f.affinity does not match"},
		{"untolerated taint", Placement{Field: "f"}, node("n", labels, drain), "taint kubevirt.io/drain:NoSchedule not tolerated by f.tolerations"},
		{"tolerated taint", Placement{Field: "f", Tolerations: tolerateDrain}, node("n", labels, drain), ""},
		{"condition taint, ordinary workload", Placement{Field: "f"}, node("n", labels, unreachable), "taint node.kubernetes.io/unreachable:NoExecute not tolerated by f.tolerations"},
		{"condition taint, daemon", Placement{Field: "f", DaemonLike: true}, node("n", labels, unreachable), ""},
	} {
		if got := Admits(tc.p, tc.n); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
