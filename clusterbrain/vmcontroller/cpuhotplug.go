package vmcontroller

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
)

// CPU hotplug, as KubeVirt's virt-controller decides it under the
// LiveUpdate rollout strategy: a running VM whose template asks for more
// CPU sockets than its VMI has, up to the VMI's maxSockets (set when the
// VMI was created, rollout.SetupCPUHotplug), gets its VMI's sockets (and
// the CPU requests and limits the VMI has, by a 1/cpuAllocationRatio CPU
// per vCPU) patched; the VMI's node agent plugs the vCPUs into the live
// domain, reports status.currentCPUTopology and clears the VMI's
// HotVCPUChange condition. Fewer sockets, more than maxSockets, a VMI
// started without maxSockets, or the Stage strategy need a restart. A VM
// with an instance type takes its CPU from it: an instance type change
// needs a restart (the start digest covers it).

// KubeVirt's RestartRequired messages of a CPU change.
const (
	msgSocketsAboveMax  = "CPU sockets updated in template spec to a value higher than what's available"
	msgSocketsReduction = "Reduction of CPU socket count requires a restart"
)

// wantedSockets is the CPU sockets vm's template asks for; false when its
// instance type decides them.
func wantedSockets(vm *kubevirtv1.VirtualMachine) (uint32, bool) {
	if vm.Spec.Instancetype != nil {
		return 0, false
	}
	cpu := vm.Spec.Template.Spec.Domain.CPU
	if cpu == nil || cpu.Sockets == 0 {
		return 1, true // the VMI defaults' single socket
	}
	return cpu.Sockets, true
}

// liveCPU carries a change of vm's CPU sockets to vmi where cfg allows it;
// it returns why a restart is needed instead ("": nothing to restart for).
func (c *Controller) liveCPU(ctx context.Context, cfg rollout.Cluster, vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) (string, error) {
	want, ok := wantedSockets(vm)
	cpu := vmi.Spec.Domain.CPU
	if !ok || cpu == nil || want == cpu.Sockets {
		return "", nil
	}
	switch {
	case !cfg.LiveUpdate() || cpu.MaxSockets == 0:
		return msgRestartRequired, nil
	case want > cpu.MaxSockets:
		return msgSocketsAboveMax, nil
	case want < cpu.Sockets:
		return msgSocketsReduction, nil
	case vmiCondition(vmi, kubevirtv1.VirtualMachineInstanceVCPUChange):
		return "", nil // the node's answer (a VMI update) brings us back
	}
	data, err := socketsPatch(vmi, want, cfg.MilliCPUPerVCPU())
	if err != nil {
		return "", err
	}
	if _, err := c.cfg.Virt.VMIs.Patch(ctx, vmi.Namespace, vmi.Name, types.JSONPatchType, data, metav1.PatchOptions{}); err != nil {
		return "", fmt.Errorf("patch vmi cpu sockets: %w", err)
	}
	c.recorder.Eventf(vm, corev1.EventTypeNormal, "CPUHotplug", "Hot-plugging CPU sockets %d → %d into the running VMI", cpu.Sockets, want)
	return "", nil
}

// socketsPatch sets vmi's CPU sockets to sockets, raising the CPU requests
// and limits it has by milliPerVCPU for each added vCPU, as
// virt-controller does. The VMI must still be the one the change was
// computed from (its resourceVersion is tested): a stale cached VMI may
// not show the node's HotVCPUChange yet.
func socketsPatch(vmi *kubevirtv1.VirtualMachineInstance, sockets uint32, milliPerVCPU int64) ([]byte, error) {
	type op struct {
		Op    string `json:"op"`
		Path  string `json:"path"`
		Value any    `json:"value"`
	}
	cpu := vmi.Spec.Domain.CPU
	ops := []op{{"test", "/metadata/resourceVersion", vmi.ResourceVersion},
		{"test", "/spec/domain/cpu/sockets", cpu.Sockets}, {"replace", "/spec/domain/cpu/sockets", sockets}}
	added := int64(sockets-cpu.Sockets) * int64(max(cpu.Cores, 1)*max(cpu.Threads, 1))
	res := vmi.Spec.Domain.Resources
	for _, r := range []struct {
		path string
		list corev1.ResourceList
	}{{"/spec/domain/resources/requests/cpu", res.Requests}, {"/spec/domain/resources/limits/cpu", res.Limits}} {
		q, ok := r.list[corev1.ResourceCPU]
		if !ok || q.IsZero() {
			continue
		}
		grown := q.DeepCopy()
		grown.Add(*resource.NewMilliQuantity(added*milliPerVCPU, resource.DecimalSI))
		ops = append(ops, op{"test", r.path, q.String()}, op{"replace", r.path, grown.String()})
	}
	return json.Marshal(ops)
}

func vmiCondition(vmi *kubevirtv1.VirtualMachineInstance, t kubevirtv1.VirtualMachineInstanceConditionType) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == t && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}
