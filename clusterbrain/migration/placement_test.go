package migration

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	migrationsv1alpha1 "kubevirt.io/api/migrations/v1alpha1"
)

// TestPlacementOfAMigration: the scheduler is asked for the VMI with the
// migration's addedNodeSelector added, the source node excluded in every
// affinity term, and no volumes; the VMI itself is not changed.
func TestPlacementOfAMigration(t *testing.T) {
	vmi := &kubevirtv1.VirtualMachineInstance{
		Spec: kubevirtv1.VirtualMachineInstanceSpec{
			NodeSelector: map[string]string{"disk": "ssd"},
			Affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{
					{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"a"}}}},
					{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"b"}}}},
				}}}},
			Volumes: []kubevirtv1.Volume{{Name: "root", VolumeSource: kubevirtv1.VolumeSource{
				DataVolume: &kubevirtv1.DataVolumeSource{Name: "root"}}}},
		},
		Status: kubevirtv1.VirtualMachineInstanceStatus{NodeName: "src"},
	}
	mig := &kubevirtv1.VirtualMachineInstanceMigration{ObjectMeta: metav1.ObjectMeta{Name: "m"},
		Spec: kubevirtv1.VirtualMachineInstanceMigrationSpec{AddedNodeSelector: map[string]string{"rack": "r2"}}}
	p := placementOf(vmi, mig)
	if p.Spec.NodeSelector["disk"] != "ssd" || p.Spec.NodeSelector["rack"] != "r2" {
		t.Errorf("node selector %v", p.Spec.NodeSelector)
	}
	if len(p.Spec.Volumes) != 0 {
		t.Errorf("volumes %v", p.Spec.Volumes)
	}
	for i, term := range p.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		last := term.MatchExpressions[len(term.MatchExpressions)-1]
		if last.Key != corev1.LabelHostname || last.Operator != corev1.NodeSelectorOpNotIn || len(last.Values) != 1 || last.Values[0] != "src" {
			t.Errorf("term %d does not exclude the source: %+v", i, term)
		}
	}
	if len(vmi.Spec.NodeSelector) != 1 || len(vmi.Spec.Volumes) != 1 ||
		len(vmi.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[0].MatchExpressions) != 1 {
		t.Errorf("the VMI was changed: %+v", vmi.Spec)
	}

	// Without any affinity: one term, the source excluded.
	bare := &kubevirtv1.VirtualMachineInstance{Status: kubevirtv1.VirtualMachineInstanceStatus{NodeName: "src"}}
	terms := placementOf(bare, &kubevirtv1.VirtualMachineInstanceMigration{}).Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	if len(terms) != 1 || len(terms[0].MatchExpressions) != 1 || terms[0].MatchExpressions[0].Values[0] != "src" {
		t.Errorf("terms %+v", terms)
	}
}

// TestReplacementClaim: the replacement keeps the claim's name, labels,
// annotations (import state included) and owner, drops the PV
// controller's bind annotations, and binds the target's volume on the
// target node.
func TestReplacementClaim(t *testing.T) {
	yes := true
	old := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "root", Namespace: "ns", UID: "u1", ResourceVersion: "7",
			Labels: map[string]string{"app": "x"},
			Annotations: map[string]string{"pv.kubernetes.io/bind-completed": "yes", "cdi.kubevirt.io/storage.pod.phase": "Succeeded",
				"volume.kubernetes.io/selected-node": "src"},
			OwnerReferences: []metav1.OwnerReference{{Kind: "DataVolume", Name: "root", Controller: &yes}},
			Finalizers:      []string{"kubernetes.io/pvc-protection"}},
		Spec: corev1.PersistentVolumeClaimSpec{VolumeName: "pvc-u1", AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}},
	}
	r := replacementOf(old, "mig-m-root", "dst")
	switch {
	case r.Name != "root" || r.Namespace != "ns" || r.UID != "" || r.ResourceVersion != "" || len(r.Finalizers) != 0:
		t.Errorf("meta %+v", r.ObjectMeta)
	case r.Labels["app"] != "x" || len(r.OwnerReferences) != 1 || r.OwnerReferences[0].Name != "root":
		t.Errorf("labels/owner %+v", r.ObjectMeta)
	case r.Annotations["cdi.kubevirt.io/storage.pod.phase"] != "Succeeded" || r.Annotations["volume.kubernetes.io/selected-node"] != "dst" ||
		r.Annotations["pv.kubernetes.io/bind-completed"] != "":
		t.Errorf("annotations %v", r.Annotations)
	case r.Spec.VolumeName != "mig-m-root" || r.Spec.AccessModes[0] != corev1.ReadWriteOnce:
		t.Errorf("spec %+v", r.Spec)
	}
	if old.Annotations["volume.kubernetes.io/selected-node"] != "src" || old.Spec.VolumeName != "pvc-u1" {
		t.Error("the old claim was changed")
	}
}

// TestMatchPolicy: upstream's choice among MigrationPolicies.
func TestMatchPolicy(t *testing.T) {
	pol := func(name string, ns, vmi map[string]string) migrationsv1alpha1.MigrationPolicy {
		return migrationsv1alpha1.MigrationPolicy{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: migrationsv1alpha1.MigrationPolicySpec{
			Selectors: &migrationsv1alpha1.Selectors{NamespaceSelector: ns, VirtualMachineInstanceSelector: vmi}}}
	}
	policies := []migrationsv1alpha1.MigrationPolicy{
		pol("z-ns", map[string]string{"team": "a"}, nil),
		pol("b-vmi", nil, map[string]string{"tier": "db"}),
		pol("a-vmi", nil, map[string]string{"tier": "db"}),
		pol("both", map[string]string{"team": "a"}, map[string]string{"tier": "db"}),
		pol("other", nil, map[string]string{"tier": "web"}),
	}
	for _, tc := range []struct {
		vmi, ns map[string]string
		want    string
	}{
		{map[string]string{"tier": "db"}, map[string]string{"team": "a"}, "both"},
		{map[string]string{"tier": "db"}, map[string]string{"team": "b"}, "a-vmi"},
		{map[string]string{"tier": "cache"}, map[string]string{"team": "a"}, "z-ns"},
		{map[string]string{"tier": "cache"}, nil, ""},
	} {
		got := MatchPolicy(policies, tc.vmi, tc.ns)
		name := ""
		if got != nil {
			name = got.Name
		}
		if name != tc.want {
			t.Errorf("vmi %v ns %v: policy %q, want %q", tc.vmi, tc.ns, name, tc.want)
		}
	}
}
