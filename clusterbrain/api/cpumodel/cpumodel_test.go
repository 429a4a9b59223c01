package cpumodel

import (
	"testing"

	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestFromKubeVirt(t *testing.T) {
	kv := func(model string, obsolete map[string]bool) *kubevirtv1.KubeVirt {
		return &kubevirtv1.KubeVirt{Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
			CPUModel: model, ObsoleteCPUModels: obsolete}}}
	}
	for _, c := range []struct {
		name     string
		c        Cluster
		def      string
		obsolete map[string]bool // model → obsolete
	}{
		// The zero Cluster (an unset live.Value) is the settings without a CR.
		{"zero", Cluster{}, "", map[string]bool{"486": true, "qemu64": true, "Haswell-noTSX": false, "": false}},
		{"no CR", FromKubeVirt(nil), "", map[string]bool{"486": true, "kvm32": true, "Haswell-noTSX": false}},
		{"CR without a list", FromKubeVirt(kv("Haswell-noTSX", nil)), "Haswell-noTSX", map[string]bool{"486": true, "Haswell-noTSX": false}},
		{"CR's own list", FromKubeVirt(kv("", map[string]bool{"Penryn": true, "486": false})), "",
			map[string]bool{"Penryn": true, "486": false, "qemu64": false}},
		{"CR's empty list", FromKubeVirt(kv("", map[string]bool{})), "", map[string]bool{"486": false}},
	} {
		if c.c.Default != c.def {
			t.Errorf("%s: default %q, want %q", c.name, c.c.Default, c.def)
		}
		for m, want := range c.obsolete {
			if got := c.c.IsObsolete(m); got != want {
				t.Errorf("%s: %q obsolete %v, want %v", c.name, m, got, want)
			}
		}
	}
}

func TestApplyAndCheck(t *testing.T) {
	c := Cluster{Default: "Haswell-noTSX"}
	var spec kubevirtv1.VirtualMachineInstanceSpec
	if !c.Apply(&spec) || spec.Domain.CPU.Model != "Haswell-noTSX" {
		t.Errorf("no model: applied %+v", spec.Domain.CPU)
	}
	spec.Domain.CPU.Model = "486"
	if c.Apply(&spec) || spec.Domain.CPU.Model != "486" {
		t.Errorf("own model replaced: %+v", spec.Domain.CPU)
	}
	if errs := c.Check(field.NewPath("spec"), &spec); len(errs) != 1 || errs[0].Field != "spec.domain.cpu.model" {
		t.Errorf("obsolete model: %v", errs)
	}
	if (Cluster{}).Apply(&kubevirtv1.VirtualMachineInstanceSpec{}) {
		t.Error("no default applied something")
	}
}
