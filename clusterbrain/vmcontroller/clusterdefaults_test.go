package vmcontroller

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
)

// TestVMIsGetTheKubeVirtCRsDefaults: the VMIs the controller creates get
// what the KubeVirt CR in force says (as the brain feeds the live values from
// it): the default CPU model, and the memory request of a guest-only
// template overcommitted; a changed percentage applies to the next VMI.
func TestVMIsGetTheKubeVirtCRsDefaults(t *testing.T) {
	cpu, mem := &live.Value[cpumodel.Cluster]{}, &live.Value[overcommit.Memory]{}
	cpu.Set(cpumodel.Cluster{Default: "Haswell-noTSX", Obsolete: map[string]bool{}})
	mem.Set(200)
	e := setup(t, func(c *Config) { c.CPUModels, c.MemoryOvercommit = cpu, mem })

	created := func(vmi *kubevirtv1.VirtualMachineInstance) string {
		r := vmi.Spec.Domain.Resources.Requests[corev1.ResourceMemory]
		return r.String()
	}
	e.newVM("dense", nil) // 64Mi of guest memory, no request
	_, vmi := e.waitVM("dense", "its VMI", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi != nil })
	if got := created(vmi); got != "32Mi" {
		t.Errorf("memory request %s at 200%%, want 32Mi", got)
	}
	if vmi.Spec.Domain.Memory == nil || vmi.Spec.Domain.Memory.Guest.String() != "64Mi" {
		t.Errorf("guest memory %+v, want 64Mi", vmi.Spec.Domain.Memory)
	}
	if vmi.Spec.Domain.CPU == nil || vmi.Spec.Domain.CPU.Model != "Haswell-noTSX" {
		t.Errorf("cpu %+v, want the default model", vmi.Spec.Domain.CPU)
	}

	mem.Set(overcommit.Default)
	e.newVM("plain", nil)
	_, vmi = e.waitVM("plain", "its VMI", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi != nil })
	if got := created(vmi); got != "64Mi" {
		t.Errorf("memory request %s at 100%%, want 64Mi", got)
	}
}
