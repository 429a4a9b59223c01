// Package featuregate says which KubeVirt and CDI feature gates nodevirt
// implements and whether a KubeVirt or CDI CR turns one on.
//
// A gate is advertised on a rendered KubeVirt or CDI CR only when nodevirt
// has the feature behind it (KubeVirtImplemented, CDIImplemented); the HCO
// renderer filters what upstream HCO would set through them. An
// administrator may still add any gate with HCO's JSON-patch annotations;
// only the gates listed here change what nodevirt does.
package featuregate

import (
	"slices"

	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

// KubeVirt feature gates nodevirt implements.
const (
	// HostDisk allows hostDisk volumes (alpha in KubeVirt: off unless
	// listed). Without it, VMIs and VMs using one are refused at admission
	// and the node agent refuses to start them.
	HostDisk = "HostDisk"
	// VideoConfig allows spec.domain.devices.video. nodevirt honours the
	// field whether or not the gate is listed (it is on by default in the
	// KubeVirt releases whose API nodevirt serves), so the gate is only
	// passed through when HCO asks for it.
	VideoConfig = "VideoConfig"
	// DeclarativeHotplugVolumes makes the VM controller plug hotpluggable
	// volumes added to a running VM's template into its VMI (and unplug
	// those removed), and the VMI's addvolume/removevolume refuse a VMI a
	// VM owns (see clusterbrain/api/rollout).
	DeclarativeHotplugVolumes = "DeclarativeHotplugVolumes"
	// HotplugVolumes is KubeVirt's older hotplug gate; listed, it takes
	// precedence over DeclarativeHotplugVolumes (no declarative hotplug,
	// ephemeral VMI hotplug allowed). The subresources are served with
	// either gate or none.
	HotplugVolumes = "HotplugVolumes"
	// ObjectGraph serves the objectgraph subresource of VMs and VMIs
	// (alpha in KubeVirt): without it the request is refused, as by
	// virt-api.
	ObjectGraph = "ObjectGraph"
)

// CDI feature gates nodevirt implements.
const (
	// HonorWaitForFirstConsumer makes DataVolumes on WaitForFirstConsumer
	// storage classes wait for their first consumer. Without it, the
	// DataVolume controller places the claim at once (CDI's behaviour with
	// the gate off).
	HonorWaitForFirstConsumer = "HonorWaitForFirstConsumer"
)

// KubeVirtImplemented are the KubeVirt gates that gate something nodevirt
// does. Rendered KubeVirt CRs advertise no other gate.
var KubeVirtImplemented = []string{HostDisk, VideoConfig, DeclarativeHotplugVolumes, HotplugVolumes, ObjectGraph}

// CDIImplemented are the CDI gates that gate something nodevirt does.
var CDIImplemented = []string{HonorWaitForFirstConsumer}

// Implemented filters gates down to those in implemented, keeping order.
func Implemented(gates, implemented []string) []string {
	var out []string
	for _, g := range gates {
		if slices.Contains(implemented, g) {
			out = append(out, g)
		}
	}
	return out
}

// KubeVirtEnabled reports whether kv turns gate on: listed in
// spec.configuration.developerConfiguration.featureGates and not in its
// disabledFeatureGates. A nil kv (no KubeVirt CR) enables nothing.
func KubeVirtEnabled(kv *kubevirtv1.KubeVirt, gate string) bool {
	if kv == nil {
		return false
	}
	dc := kv.Spec.Configuration.DeveloperConfiguration
	if dc == nil {
		return false
	}
	return slices.Contains(dc.FeatureGates, gate) && !slices.Contains(dc.DisabledFeatureGates, gate)
}

// CDIEnabled reports whether the CDI configuration cfg turns gate on. A nil
// cfg (no CDI CR) enables nothing.
func CDIEnabled(cfg *cdiv1.CDIConfigSpec, gate string) bool {
	return cfg != nil && slices.Contains(cfg.FeatureGates, gate)
}

// UsesHostDisk reports whether spec has a hostDisk volume.
func UsesHostDisk(spec *kubevirtv1.VirtualMachineInstanceSpec) bool {
	for _, v := range spec.Volumes {
		if v.HostDisk != nil {
			return true
		}
	}
	return false
}
