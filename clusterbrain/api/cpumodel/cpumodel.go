// Package cpumodel applies the KubeVirt CR's CPU model settings to VMIs,
// as KubeVirt does: spec.configuration.cpuModel is the model of every VMI
// created without one (virt-api's VMI defaulting), and a model in
// spec.configuration.obsoleteCPUModels is one no node offers (virt-handler's
// node labeller leaves it out), so a VMI asking for it never runs.
//
// In nodevirt the default is set by the brain's VMI mutating webhook and by
// its VM controller (which creates VMIs in process), so the VMI's spec
// carries the model its domain gets and a migration target builds the same
// CPU. An obsolete model is refused where KubeVirt would leave the VMI
// unschedulable: at the VMI and VM webhooks (naming the model). A VMI
// admitted before its model became obsolete is left alone.
//
// The zero Cluster is the settings without a KubeVirt CR (no default,
// KubeVirt's obsolete list), so an unset live.Value of it reads right.
package cpumodel

import (
	"fmt"
	"slices"

	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// KubeVirtObsolete is KubeVirt's own obsoleteCPUModels list, in force when
// the KubeVirt CR sets none (HCO renders this list plus its own additions).
var KubeVirtObsolete = []string{"486", "pentium", "pentium2", "pentium3", "pentiumpro", "coreduo", "n270",
	"core2duo", "Conroe", "athlon", "phenom", "qemu64", "qemu32", "kvm64", "kvm32"}

// Cluster is what the KubeVirt CR says about CPU models.
type Cluster struct {
	// Default is the model of VMIs that name none ("": none, the node's
	// host-model).
	Default string
	// Obsolete are the models no node offers (nil: KubeVirtObsolete).
	Obsolete map[string]bool
}

// FromKubeVirt reads kv (nil: no default, KubeVirt's obsolete list).
func FromKubeVirt(kv *kubevirtv1.KubeVirt) Cluster {
	var c Cluster
	if kv == nil {
		return c
	}
	c.Default = kv.Spec.Configuration.CPUModel
	if kv.Spec.Configuration.ObsoleteCPUModels != nil {
		c.Obsolete = map[string]bool{}
		for m, on := range kv.Spec.Configuration.ObsoleteCPUModels {
			if on {
				c.Obsolete[m] = true
			}
		}
	}
	return c
}

// IsObsolete says whether model is obsolete.
func (c Cluster) IsObsolete(model string) bool {
	if c.Obsolete == nil {
		return slices.Contains(KubeVirtObsolete, model)
	}
	return c.Obsolete[model]
}

// Apply gives spec the default model when it names none; it reports
// whether it changed spec.
func (c Cluster) Apply(spec *kubevirtv1.VirtualMachineInstanceSpec) bool {
	if c.Default == "" || spec.Domain.CPU != nil && spec.Domain.CPU.Model != "" {
		return false
	}
	if spec.Domain.CPU == nil {
		spec.Domain.CPU = &kubevirtv1.CPU{}
	}
	spec.Domain.CPU.Model = c.Default
	return true
}

// Check refuses an obsolete model in spec (at path, the VMI spec's).
func (c Cluster) Check(path *field.Path, spec *kubevirtv1.VirtualMachineInstanceSpec) field.ErrorList {
	if cpu := spec.Domain.CPU; cpu != nil && c.IsObsolete(cpu.Model) {
		return field.ErrorList{field.Invalid(path.Child("domain", "cpu", "model"), cpu.Model, c.Why(cpu.Model))}
	}
	return nil
}

// Why says why model is refused.
func (c Cluster) Why(model string) string {
	return fmt.Sprintf("CPU model %q is obsolete (the KubeVirt CR's obsoleteCPUModels): no node offers it", model)
}
