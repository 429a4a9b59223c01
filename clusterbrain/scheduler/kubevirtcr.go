package scheduler

import (
	"fmt"
	"strings"

	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
)

// What the scheduler takes from the KubeVirt CR: whether software
// emulation is allowed, the memory overcommit (demandOf), the workloads
// placement and the permitted host devices.
//
// The KubeVirt CR's spec.workloads.nodePlacement (HCO renders its own
// spec.workloads into it) is where KubeVirt runs virt-handler, and a VMI
// runs only where virt-handler does: its launcher pod needs the node's
// kubevirt.io/schedulable label, which only virt-handler sets. nodevirt's
// node agents run on every node, so the scheduler applies the placement
// itself: a node it does not admit takes no VMI, whether created, reserved
// before creation or the target of a migration. The placement is read as
// virt-handler's DaemonSet pods read it: its node selector, required node
// affinity and tolerations, the node.kubernetes.io/ condition taints
// tolerated anyway. VMIs already running on a node the placement leaves
// out keep running (KubeVirt does not evict them either).

// watchKubeVirt reacts to KubeVirt CR changes: emulation, the workloads
// placement and the memory overcommit (part of the memoised demands) may
// have changed.
func (s *Scheduler) watchKubeVirt() {
	changed := func() { s.forgetPlacements(); s.retryWaiting() }
	_, _ = s.kvs.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { changed() },
		UpdateFunc: func(any, any) { changed() },
		DeleteFunc: func(any) { changed() },
	})
}

// allowEmulation is true unless a KubeVirt CR exists and none of them
// allows software emulation.
func (s *Scheduler) allowEmulation() bool {
	kvs := s.kvs.GetStore().List()
	if len(kvs) == 0 {
		return true
	}
	for _, o := range kvs {
		kv := o.(*kubevirtv1.KubeVirt)
		if c := kv.Spec.Configuration.DeveloperConfiguration; c != nil && c.UseEmulation {
			return true
		}
	}
	return false
}

// workloadsField names the placement in Unschedulable messages: the same
// path in the HyperConverged and the KubeVirt CR.
const workloadsField = "spec.workloads.nodePlacement"

// workloadPlacement is the placement of the KubeVirt CR in force, or nil
// when there is none or it places VMIs anywhere.
func (s *Scheduler) workloadPlacement() *nodeplacement.Placement {
	return placementOf(crwatch.Live[*kubevirtv1.KubeVirt](s.kvs.GetStore().List()))
}

// memoryOvercommit is the memory overcommit of the KubeVirt CR in force.
func (s *Scheduler) memoryOvercommit() overcommit.Memory {
	return overcommit.FromKubeVirt(crwatch.Live[*kubevirtv1.KubeVirt](s.kvs.GetStore().List()))
}

// placementOf reads kv's workloads placement (nil: none).
func placementOf(kv *kubevirtv1.KubeVirt) *nodeplacement.Placement {
	if kv == nil || kv.Spec.Workloads == nil || kv.Spec.Workloads.NodePlacement == nil {
		return nil
	}
	np := kv.Spec.Workloads.NodePlacement
	if len(np.NodeSelector) == 0 && np.Affinity == nil && len(np.Tolerations) == 0 {
		return nil
	}
	return &nodeplacement.Placement{NodeSelector: np.NodeSelector, Affinity: np.Affinity, Tolerations: np.Tolerations,
		Field: workloadsField, DaemonLike: true}
}

// permittedHostDevices is the KubeVirt CR's list of the host devices VMIs
// may ask for (nil: no CR, or no list).
func (s *Scheduler) permittedHostDevices() *kubevirtv1.PermittedHostDevices {
	kv := crwatch.Live[*kubevirtv1.KubeVirt](s.kvs.GetStore().List())
	if kv == nil {
		return nil
	}
	return kv.Spec.Configuration.PermittedHostDevices
}

// unpermittedDevices is KubeVirt's refusal of the GPUs and host devices of
// spec that permitted does not list by resource name, as virt-controller
// gives it when it renders the launcher pod (the VMI is then not
// scheduled); "" when every one is listed, and always with no list.
func unpermittedDevices(spec *kubevirtv1.VirtualMachineInstanceSpec, permitted *kubevirtv1.PermittedHostDevices) string {
	if permitted == nil {
		return ""
	}
	listed := map[string]bool{}
	for _, d := range permitted.PciHostDevices {
		listed[d.ResourceName] = true
	}
	for _, d := range permitted.MediatedDevices {
		listed[d.ResourceName] = true
	}
	for _, d := range permitted.USB {
		listed[d.ResourceName] = true
	}
	var why []string
	for _, g := range spec.Domain.Devices.GPUs {
		if !listed[g.DeviceName] {
			why = append(why, fmt.Sprintf("GPU %s is not permitted in permittedHostDevices configuration", g.DeviceName))
		}
	}
	for _, h := range spec.Domain.Devices.HostDevices {
		if !listed[h.DeviceName] {
			why = append(why, fmt.Sprintf("HostDevice %s is not permitted in permittedHostDevices configuration", h.DeviceName))
		}
	}
	return strings.Join(why, " ")
}
