// Package rollout says how the KubeVirt CR wants changes to a running
// VM's spec.template carried to its VMI, as KubeVirt's virt-controller
// reads it:
//
//   - the DeclarativeHotplugVolumes gate: hotpluggable volumes added to or
//     removed from the template are plugged into or out of the VMI, unless
//     the older HotplugVolumes gate is listed too, which takes precedence.
//     KubeVirt does this whatever the rollout strategy says.
//   - spec.configuration.vmRolloutStrategy: with LiveUpdate (KubeVirt's
//     default since v1.6, and what HCO always sets) a change of the
//     template's CPU sockets is hot-plugged into the running VMI, up to the
//     VMI's maxSockets, which every VMI gets at creation (SetupCPUHotplug:
//     the spec's own, else liveUpdateConfiguration.maxCpuSockets, else the
//     sockets times maxHotplugRatio); with Stage it waits for a restart.
//
// The brain's VM controller acts on it, the VMI webhooks and the brain's
// own VMI creates default maxSockets from it; the subresource API refuses
// ephemeral (VMI-only) hotplug into a VM's VMI when declarative hotplug is
// on, as virt-api does, since the VM controller would unplug it again.
package rollout

import (
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
)

// DefaultMaxHotplugRatio is KubeVirt's liveUpdateConfiguration
// maxHotplugRatio default.
const DefaultMaxHotplugRatio = 4

// maxVCPUs bounds the vCPUs a computed maxSockets may give a VMI: the
// most a q35 guest takes without an IOMMU for interrupt remapping (x2APIC
// IDs above 254). KubeVirt bounds it at 512, which QEMU refuses to start
// without one.
const maxVCPUs = 255

// Cluster is what the KubeVirt CR says about rolling VM changes out. The
// zero Cluster is the settings without a CR.
type Cluster struct {
	// DeclarativeHotplug: hotpluggable volume changes of the template are
	// plugged into the running VMI.
	DeclarativeHotplug bool
	// Stage: vmRolloutStrategy Stage, every other template change of a
	// running VM waits for a restart. False is LiveUpdate.
	Stage bool
	// MaxCPUSockets is liveUpdateConfiguration.maxCpuSockets (0: unset).
	MaxCPUSockets uint32
	// MaxHotplugRatio is liveUpdateConfiguration.maxHotplugRatio (0:
	// KubeVirt's default).
	MaxHotplugRatio uint32
	// CPUAllocationRatio is developerConfiguration.cpuAllocationRatio (0:
	// KubeVirt's default): a hot-plugged vCPU adds a 1/ratio CPU to the
	// requests and limits a VMI has.
	CPUAllocationRatio int
}

// DefaultCPUAllocationRatio is KubeVirt's developerConfiguration
// cpuAllocationRatio default.
const DefaultCPUAllocationRatio = 10

// FromKubeVirt reads kv. Declarative hotplug is on only when the CR lists
// its gate (an alpha gate in the KubeVirt release whose API nodevirt
// serves): never without a CR (nil). A CR that names no rollout strategy
// gets KubeVirt's default, LiveUpdate.
func FromKubeVirt(kv *kubevirtv1.KubeVirt) Cluster {
	var c Cluster
	if kv == nil {
		return c
	}
	c.DeclarativeHotplug = featuregate.KubeVirtEnabled(kv, featuregate.DeclarativeHotplugVolumes) &&
		!featuregate.KubeVirtEnabled(kv, featuregate.HotplugVolumes)
	cfg := kv.Spec.Configuration
	c.Stage = cfg.VMRolloutStrategy != nil && *cfg.VMRolloutStrategy == kubevirtv1.VMRolloutStrategyStage
	if lu := cfg.LiveUpdateConfiguration; lu != nil {
		if lu.MaxCpuSockets != nil {
			c.MaxCPUSockets = *lu.MaxCpuSockets
		}
		c.MaxHotplugRatio = lu.MaxHotplugRatio
	}
	if dc := cfg.DeveloperConfiguration; dc != nil && dc.CPUAllocationRatio > 0 {
		c.CPUAllocationRatio = dc.CPUAllocationRatio
	}
	return c
}

// MilliCPUPerVCPU is what one hot-plugged vCPU adds to a VMI's CPU
// requests and limits, in millicores.
func (c Cluster) MilliCPUPerVCPU() int64 {
	ratio := c.CPUAllocationRatio
	if ratio <= 0 {
		ratio = DefaultCPUAllocationRatio
	}
	return int64(1000 / ratio)
}

// LiveUpdate reports whether CPU changes of a running VM are hot-plugged.
func (c Cluster) LiveUpdate() bool { return !c.Stage }

// SetupCPUHotplug gives s (defaulted: sockets, cores and threads set) the
// maxSockets CPU hotplug goes up to, as KubeVirt's VMI defaults do under
// LiveUpdate: the spec's own maxSockets is kept; else the cluster's
// maxCpuSockets (at least the sockets); else the sockets times the hotplug
// ratio, bounded by maxVCPUs. It reports whether it changed s.
func (c Cluster) SetupCPUHotplug(s *kubevirtv1.VirtualMachineInstanceSpec) bool {
	cpu := s.Domain.CPU
	if c.Stage || cpu == nil || cpu.MaxSockets != 0 || s.Architecture == "arm64" {
		return false
	}
	sockets, perSocket := max(cpu.Sockets, 1), max(cpu.Cores, 1)*max(cpu.Threads, 1)
	if c.MaxCPUSockets != 0 {
		cpu.MaxSockets = max(c.MaxCPUSockets, sockets)
		return true
	}
	ratio := c.MaxHotplugRatio
	if ratio == 0 {
		ratio = DefaultMaxHotplugRatio
	}
	cpu.MaxSockets = max(min(sockets*ratio, maxVCPUs/perSocket), sockets)
	return true
}
