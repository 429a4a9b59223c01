package hco

import (
	"strings"
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

// TestDefaultAndObsoleteCPUModels: the HyperConverged's defaultCPUModel
// and obsoleteCPUs, rendered into the KubeVirt CR, give a VMI created
// without a model the default (in its spec and so in its domain) and refuse
// an obsolete model, HCO's own defaults included, as the VM controller's
// in-process admission applies them.
func TestDefaultAndObsoleteCPUModels(t *testing.T) {
	hc := hcFrom(t, `{"defaultCPUModel": "Haswell-noTSX", "obsoleteCPUs": {"cpuModels": ["Penryn"]}}`)
	SetDefaults(hc)
	c, err := Render(hc, "v0")
	if err != nil {
		t.Fatal(err)
	}
	cpu := cpumodel.FromKubeVirt(c.KubeVirt)
	vmi := func(model string) *kubevirtv1.VirtualMachineInstance {
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "cpu", Namespace: "ns"}}
		v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}
		if model != "" {
			v.Spec.Domain.CPU = &kubevirtv1.CPU{Model: model}
		}
		return v
	}

	def := vmi("")
	if err := admission.AdmitVMICreate(def, cpu, overcommit.Default, rollout.Cluster{}); err != nil {
		t.Fatal(err)
	}
	if def.Spec.Domain.CPU == nil || def.Spec.Domain.CPU.Model != "Haswell-noTSX" {
		t.Fatalf("cpu after admission: %+v", def.Spec.Domain.CPU)
	}
	dom, err := domain.Convert(def, domain.Env{Emulation: true, StateDir: t.TempDir(), Taps: map[string]domain.Tap{"default": {Dev: "tap0"}}})
	if err != nil {
		t.Fatal(err)
	}
	if dom.CPU == nil || dom.CPU.Mode != "custom" || dom.CPU.Model == nil || dom.CPU.Model.Value != "Haswell-noTSX" {
		t.Errorf("domain cpu %+v", dom.CPU)
	}

	own := vmi("Skylake-Server")
	if err := admission.AdmitVMICreate(own, cpu, overcommit.Default, rollout.Cluster{}); err != nil || own.Spec.Domain.CPU.Model != "Skylake-Server" {
		t.Errorf("a VMI's own model: %v %+v", err, own.Spec.Domain.CPU)
	}
	for _, m := range []string{"Penryn", "486", "qemu64"} { // the HCO's, and upstream's defaults HCO renders
		err := admission.AdmitVMICreate(vmi(m), cpu, overcommit.Default, rollout.Cluster{})
		if err == nil || !strings.Contains(err.Error(), "obsolete") {
			t.Errorf("obsolete %s: %v", m, err)
			continue
		}
		if !strings.Contains(err.Error(), "spec.domain.cpu.model") || !strings.Contains(err.Error(), m) {
			t.Errorf("obsolete %s: refusal names neither field nor model: %v", m, err)
		}
	}

	// Without the HyperConverged fields: no default (the node's
	// host-model, or TCG's maximum), KubeVirt's obsolete list.
	hc = hcFrom(t, `{}`)
	SetDefaults(hc)
	if c, err = Render(hc, "v0"); err != nil {
		t.Fatal(err)
	}
	plain := vmi("")
	if err := admission.AdmitVMICreate(plain, cpumodel.FromKubeVirt(c.KubeVirt), overcommit.Default, rollout.Cluster{}); err != nil || plain.Spec.Domain.CPU != nil && plain.Spec.Domain.CPU.Model != "" {
		t.Errorf("no default: %v %+v", err, plain.Spec.Domain.CPU)
	}
	if err := admission.AdmitVMICreate(vmi("Penryn"), cpumodel.FromKubeVirt(c.KubeVirt), overcommit.Default, rollout.Cluster{}); err != nil {
		t.Errorf("Penryn refused without the HyperConverged asking: %v", err)
	}
}
