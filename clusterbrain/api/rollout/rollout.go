// Package rollout says how the KubeVirt CR wants changes to a running
// VM's spec.template carried to its VMI, as KubeVirt's virt-controller
// reads it: spec.configuration.vmRolloutStrategy (LiveUpdate, KubeVirt's
// default, or Stage: everything waits for a restart) and the
// DeclarativeHotplugVolumes gate (hotpluggable volumes added to or removed
// from the template are plugged into or out of the VMI, unless the older
// HotplugVolumes gate is listed too, which takes precedence).
//
// The brain's VM controller acts on it; the subresource API refuses
// ephemeral (VMI-only) hotplug into a VM's VMI when declarative hotplug is
// on, as virt-api does, since the VM controller would unplug it again.
package rollout

import (
	"sync/atomic"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
)

// Cluster is what the KubeVirt CR says about rolling VM changes out.
type Cluster struct {
	// LiveUpdate: template changes that can be applied to a running VMI
	// are; false (Stage) leaves every change for the next start.
	LiveUpdate bool
	// DeclarativeHotplug: hotpluggable volume changes of the template are
	// plugged into the running VMI.
	DeclarativeHotplug bool
}

// FromKubeVirt reads kv. Without a CR (nil) or a strategy, the strategy is
// KubeVirt's default, LiveUpdate; declarative hotplug is on only when the
// CR lists its gate (an alpha gate in the KubeVirt release whose API
// nodevirt serves).
func FromKubeVirt(kv *kubevirtv1.KubeVirt) Cluster {
	c := Cluster{LiveUpdate: true}
	if kv == nil {
		return c
	}
	if s := kv.Spec.Configuration.VMRolloutStrategy; s != nil {
		c.LiveUpdate = *s == kubevirtv1.VMRolloutStrategyLiveUpdate
	}
	c.DeclarativeHotplug = featuregate.KubeVirtEnabled(kv, featuregate.DeclarativeHotplugVolumes) &&
		!featuregate.KubeVirtEnabled(kv, featuregate.HotplugVolumes)
	return c
}

// Live holds the settings in force. A nil *Live reads as FromKubeVirt(nil).
type Live struct{ cur atomic.Pointer[Cluster] }

// Set replaces the settings.
func (l *Live) Set(c Cluster) { l.cur.Store(&c) }

// Get returns the settings in force.
func (l *Live) Get() Cluster {
	if l != nil {
		if c := l.cur.Load(); c != nil {
			return *c
		}
	}
	return FromKubeVirt(nil)
}
