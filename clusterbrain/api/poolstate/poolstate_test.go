package poolstate

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
)

func TestPoolsFollowUpstreamRules(t *testing.T) {
	spec := func(s hppv1beta1.HostPathProvisionerSpec) *hppv1beta1.HostPathProvisioner {
		return &hppv1beta1.HostPathProvisioner{Spec: s}
	}
	pool := func(name, path string) hppv1beta1.StoragePool { return hppv1beta1.StoragePool{Name: name, Path: path} }
	for _, tc := range []struct {
		name    string
		hpp     *hppv1beta1.HostPathProvisioner
		want    []Wanted
		refused []string // substrings of each pool's refusal, "" for none
	}{
		{name: "legacy", hpp: spec(hppv1beta1.HostPathProvisionerSpec{PathConfig: &hppv1beta1.PathConfig{Path: "/var/hpvolumes/"}}),
			want: []Wanted{{Name: "legacy", Dir: "/var/hpvolumes"}}},
		{name: "pools under csi", hpp: spec(hppv1beta1.HostPathProvisionerSpec{StoragePools: []hppv1beta1.StoragePool{pool("a", "/a"), pool("b", "/b/")}}),
			want: []Wanted{{Name: "a", Dir: "/a/csi"}, {Name: "b", Dir: "/b/csi"}}},
		{name: "both", hpp: spec(hppv1beta1.HostPathProvisionerSpec{PathConfig: &hppv1beta1.PathConfig{Path: "/x"}, StoragePools: []hppv1beta1.StoragePool{pool("a", "/a")}}),
			refused: []string{"cannot be both set", "cannot be both set"}},
		{name: "neither", hpp: spec(hppv1beta1.HostPathProvisionerSpec{}), refused: []string{"either pathConfig or storage pools"}},
		{name: "duplicates", hpp: spec(hppv1beta1.HostPathProvisionerSpec{StoragePools: []hppv1beta1.StoragePool{pool("a", "/a"), pool("a", "/b"), pool("c", "/a")}}),
			refused: []string{"", "duplicate names", "duplicate paths"}},
		{name: "bad fields", hpp: spec(hppv1beta1.HostPathProvisionerSpec{StoragePools: []hppv1beta1.StoragePool{
			pool("", "/a"), pool(strings.Repeat("n", 51), "/b"), pool("../x", "/c"), pool("rel", "var/x"), pool("root", "/"),
			{Name: "claim", Path: "/d", PVCTemplate: &corev1.PersistentVolumeClaimSpec{}}}}),
			refused: []string{"cannot be blank", "greater than 50", "only letters", "absolute", "root directory", "pvcTemplate"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Pools(tc.hpp)
			if tc.want != nil {
				if len(got) != len(tc.want) {
					t.Fatalf("got %+v, want %+v", got, tc.want)
				}
				for i := range got {
					if got[i] != tc.want[i] {
						t.Errorf("pool %d: got %+v, want %+v", i, got[i], tc.want[i])
					}
				}
			}
			if tc.refused != nil {
				if len(got) != len(tc.refused) {
					t.Fatalf("got %+v, want %d pools", got, len(tc.refused))
				}
				for i, want := range tc.refused {
					if want == "" && got[i].Refused != "" || !strings.Contains(got[i].Refused, want) {
						t.Errorf("pool %d: refusal %q, want %q", i, got[i].Refused, want)
					}
					if got[i].Refused != "" && got[i].Dir != "" {
						t.Errorf("pool %d: refused with a directory %q", i, got[i].Dir)
					}
				}
			}
		})
	}
}

func TestSelectFollowsWorkloadPlacement(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{"disk": "ssd", "zone": "a"}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: "node.kubernetes.io/not-ready", Effect: corev1.TaintEffectNoSchedule}}}}
	hpp := func(w hppv1beta1.NodePlacement) *hppv1beta1.HostPathProvisioner {
		return &hppv1beta1.HostPathProvisioner{Spec: hppv1beta1.HostPathProvisionerSpec{Workload: w}}
	}
	affinity := func(op corev1.NodeSelectorOperator, vals ...string) *corev1.Affinity {
		return &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: op, Values: vals}}}}}}}
	}
	tainted := node.DeepCopy()
	tainted.Spec.Taints = append(tainted.Spec.Taints, corev1.Taint{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule})
	for _, tc := range []struct {
		name string
		w    hppv1beta1.NodePlacement
		node *corev1.Node
		want string
	}{
		{"no placement", hppv1beta1.NodePlacement{}, node, ""},
		{"selector matches", hppv1beta1.NodePlacement{NodeSelector: map[string]string{"disk": "ssd"}}, node, ""},
		{"selector misses", hppv1beta1.NodePlacement{NodeSelector: map[string]string{"disk": "hdd"}}, node, "nodeSelector disk=hdd"},
		{"affinity matches", hppv1beta1.NodePlacement{Affinity: affinity(corev1.NodeSelectorOpIn, "a", "b")}, node, ""},
		{"affinity misses", hppv1beta1.NodePlacement{Affinity: affinity(corev1.NodeSelectorOpNotIn, "a")}, node, "affinity"},
		{"untolerated taint", hppv1beta1.NodePlacement{}, tainted, "taint dedicated"},
		{"tolerated taint", hppv1beta1.NodePlacement{Tolerations: []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists}}}, tainted, ""},
	} {
		got := Select(hpp(tc.w), tc.node)
		if tc.want == "" && got != "" || !strings.Contains(got, tc.want) {
			t.Errorf("%s: Select = %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestAnnotationRoundTrip(t *testing.T) {
	in := NodePools{Pools: []PoolState{{Name: "b", Phase: PhaseFailed, Message: "x"}, {Name: "a", Path: "/a/csi", Provisioner: "hpp", Phase: PhaseReady}}}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Annotations: map[string]string{AnnotationNodePools: Encode(in)}}}
	out, err := Decode(node)
	if err != nil {
		t.Fatal(err)
	}
	if s, ok := out.Find("a"); !ok || s.Path != "/a/csi" || s.Phase != PhaseReady || out.Pools[0].Name != "a" {
		t.Fatalf("decoded %+v", out)
	}
	node.Annotations[AnnotationNodePools] = "{"
	if _, err := Decode(node); err == nil {
		t.Fatal("a broken annotation decoded")
	}
}
