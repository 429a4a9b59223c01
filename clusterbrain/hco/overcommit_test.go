package hco

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// TestHigherWorkloadDensity: the HyperConverged's
// higherWorkloadDensity.memoryOvercommitPercentage, rendered into the
// KubeVirt CR's memoryOvercommit, gives a VMI that names only its guest
// memory the request guest × 100 / percentage (the VM controller's
// in-process admission); its domain keeps the whole guest memory. A VMI's
// own request is kept; HCO's default (100) requests the guest's size.
func TestHigherWorkloadDensity(t *testing.T) {
	admitted := func(spec string, edit func(*kubevirtv1.VirtualMachineInstance)) *kubevirtv1.VirtualMachineInstance {
		t.Helper()
		hc := hcFrom(t, spec)
		SetDefaults(hc)
		c, err := Render(hc, "v0")
		if err != nil {
			t.Fatal(err)
		}
		guest := resource.MustParse("3Gi")
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "dense", Namespace: "ns"}}
		v.Spec.Domain.Memory = &kubevirtv1.Memory{Guest: &guest}
		if edit != nil {
			edit(v)
		}
		if err := admission.AdmitVMICreate(v, cpumodel.FromKubeVirt(c.KubeVirt), overcommit.FromKubeVirt(c.KubeVirt), rollout.FromKubeVirt(c.KubeVirt)); err != nil {
			t.Fatal(err)
		}
		return v
	}
	request := func(v *kubevirtv1.VirtualMachineInstance) string {
		r := v.Spec.Domain.Resources.Requests[corev1.ResourceMemory]
		return r.String()
	}

	dense := admitted(`{"higherWorkloadDensity": {"memoryOvercommitPercentage": 150}}`, nil)
	if got := request(dense); got != "2Gi" {
		t.Errorf("request at 150%%: %s, want 2Gi", got)
	}
	dom, err := domain.Convert(dense, domain.Env{Emulation: true, StateDir: t.TempDir(), Taps: map[string]domain.Tap{"default": {Dev: "tap0"}}})
	if err != nil {
		t.Fatal(err)
	}
	if dom.Memory == nil || dom.Memory.Value != 3<<20 || dom.Memory.Unit != "KiB" {
		t.Errorf("domain memory %+v, want the whole 3Gi guest", dom.Memory)
	}

	own := admitted(`{"higherWorkloadDensity": {"memoryOvercommitPercentage": 150}}`, func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("3Gi")}
	})
	if got := request(own); got != "3Gi" {
		t.Errorf("a VMI's own request became %s", got)
	}
	if got := request(admitted(`{}`, nil)); got != "3Gi" {
		t.Errorf("request with HCO's default: %s, want the guest's 3Gi", got)
	}
}
