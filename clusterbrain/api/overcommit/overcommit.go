// Package overcommit applies the KubeVirt CR's developerConfiguration
// memoryOvercommit (HCO's higherWorkloadDensity.memoryOvercommitPercentage)
// to VMIs, as KubeVirt's VMI defaulting does: a VMI that gives its guest
// memory and no memory request is given the request guest × 100 /
// percentage, so a node holds more guests than its memory (the guest still
// sees all of its memory). A VMI's own request, or one with only a memory
// limit, is left alone.
//
// In nodevirt the request is set by the brain's VMI mutating webhook and by
// its VM and replica set controllers (which create VMIs past the webhooks,
// applying them in process); the scheduler counts the request, and applies
// the percentage itself to a VMI that reached it without one, as do the
// capacity pods that hold a VMI's share for kube-scheduler.
package overcommit

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Default is KubeVirt's memoryOvercommit when the KubeVirt CR sets none: a
// guest's request is its memory.
const Default = 100

// Memory is a memory overcommit percentage; 0 (unset, as in the KubeVirt
// CR) is Default.
type Memory int

// FromKubeVirt reads kv's memoryOvercommit (nil, or none set: Default).
func FromKubeVirt(kv *kubevirtv1.KubeVirt) Memory {
	if kv != nil {
		if dc := kv.Spec.Configuration.DeveloperConfiguration; dc != nil && dc.MemoryOvercommit > 0 {
			return Memory(dc.MemoryOvercommit)
		}
	}
	return Default
}

// Request is the memory request of a guest of guest bytes.
func (m Memory) Request(guest int64) int64 {
	if m <= 0 || m == Default {
		return guest
	}
	return guest * 100 / int64(m)
}

// Apply gives spec the memory request of its guest memory when it has
// none; it reports whether it changed spec.
func (m Memory) Apply(spec *kubevirtv1.VirtualMachineInstanceSpec) bool {
	d := &spec.Domain
	if _, ok := d.Resources.Requests[corev1.ResourceMemory]; ok || d.Memory == nil || d.Memory.Guest == nil || d.Memory.Guest.Value() <= 0 {
		return false
	}
	if d.Resources.Requests == nil {
		d.Resources.Requests = corev1.ResourceList{}
	}
	g := d.Memory.Guest
	if m.Request(g.Value()) == g.Value() {
		d.Resources.Requests[corev1.ResourceMemory] = g.DeepCopy()
	} else {
		d.Resources.Requests[corev1.ResourceMemory] = *resource.NewQuantity(m.Request(g.Value()), g.Format)
	}
	return true
}
