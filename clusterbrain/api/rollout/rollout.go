// Package rollout says how the KubeVirt CR wants changes to a running
// VM's spec.template carried to its VMI, as KubeVirt's virt-controller
// reads it: the DeclarativeHotplugVolumes gate (hotpluggable volumes added
// to or removed from the template are plugged into or out of the VMI,
// unless the older HotplugVolumes gate is listed too, which takes
// precedence). KubeVirt applies declarative volume hotplug whatever
// spec.configuration.vmRolloutStrategy says; that strategy only decides
// whether CPU, memory and placement changes are live-updated, which
// nodevirt does not do yet (they always need a restart), so it is not read.
//
// The brain's VM controller acts on it; the subresource API refuses
// ephemeral (VMI-only) hotplug into a VM's VMI when declarative hotplug is
// on, as virt-api does, since the VM controller would unplug it again.
package rollout

import (
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
)

// Cluster is what the KubeVirt CR says about rolling VM changes out. The
// zero Cluster is the settings without a CR.
type Cluster struct {
	// DeclarativeHotplug: hotpluggable volume changes of the template are
	// plugged into the running VMI.
	DeclarativeHotplug bool
}

// FromKubeVirt reads kv. Declarative hotplug is on only when the CR lists
// its gate (an alpha gate in the KubeVirt release whose API nodevirt
// serves): never without a CR (nil).
func FromKubeVirt(kv *kubevirtv1.KubeVirt) Cluster {
	var c Cluster
	if kv == nil {
		return c
	}
	c.DeclarativeHotplug = featuregate.KubeVirtEnabled(kv, featuregate.DeclarativeHotplugVolumes) &&
		!featuregate.KubeVirtEnabled(kv, featuregate.HotplugVolumes)
	return c
}
