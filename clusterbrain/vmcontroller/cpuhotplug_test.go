package vmcontroller

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
)

func sockets(vmi *kubevirtv1.VirtualMachineInstance) uint32 {
	if vmi == nil || vmi.Spec.Domain.CPU == nil {
		return 0
	}
	return vmi.Spec.Domain.CPU.Sockets
}

// setVCPUChange sets or clears the VMI's HotVCPUChange condition, as the
// node agent does while it plugs vCPUs.
func (e env) setVCPUChange(name string, on bool) {
	e.t.Helper()
	vmi, err := e.virt.VMIs.Get(context.Background(), e.ns, name)
	if err != nil {
		e.t.Fatal(err)
	}
	conds := vmi.Status.Conditions[:0]
	for _, c := range vmi.Status.Conditions {
		if c.Type != kubevirtv1.VirtualMachineInstanceVCPUChange {
			conds = append(conds, c)
		}
	}
	if on {
		conds = append(conds, kubevirtv1.VirtualMachineInstanceCondition{Type: kubevirtv1.VirtualMachineInstanceVCPUChange, Status: corev1.ConditionTrue})
	}
	vmi.Status.Conditions = conds
	if _, err := e.virt.VMIs.UpdateStatus(context.Background(), vmi); err != nil {
		e.t.Fatal(err)
	}
}

// Under LiveUpdate a VMI is started with maxSockets (4× its sockets), and
// more sockets in the running VM's template reach the VMI's spec, its CPU
// request growing by a tenth of a CPU per vCPU; one change at a time (not
// while the node still plugs the last); fewer sockets, or more than
// maxSockets, set RestartRequired with KubeVirt's messages.
func TestCPUHotplugLiveUpdate(t *testing.T) {
	cluster := &live.Value[rollout.Cluster]{}
	e := setup(t, func(c *Config) { c.Rollout = cluster })
	e.newVM("cpu", func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.Template.Spec.Domain.CPU = &kubevirtv1.CPU{Sockets: 1, Cores: 2}
		vm.Spec.Template.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m")}
	})
	_, vmi := e.waitVM("cpu", "vmi created", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi != nil })
	if got := vmi.Spec.Domain.CPU.MaxSockets; got != 4 {
		t.Fatalf("vmi maxSockets %d, want 4 (sockets × KubeVirt's hotplug ratio)", got)
	}
	e.setVMIPhase(vmi, kubevirtv1.Running, true)

	e.patchVM("cpu", `{"spec":{"template":{"spec":{"domain":{"cpu":{"sockets":2}}}}}}`)
	vm, vmi := e.waitVM("cpu", "2 sockets on the vmi", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return sockets(vmi) == 2
	})
	if msg, ok := restartRequired(vm); ok {
		t.Errorf("RestartRequired after a hotplug within maxSockets: %s", msg)
	}
	// 2 more vCPUs (2 cores a socket) at 100m each.
	if q := vmi.Spec.Domain.Resources.Requests[corev1.ResourceCPU]; q.MilliValue() != 700 {
		t.Errorf("vmi cpu request %s after the hotplug, want 700m", q.String())
	}

	// The node has not finished: the next change waits for it.
	e.setVCPUChange("cpu", true)
	e.patchVM("cpu", `{"spec":{"template":{"spec":{"domain":{"cpu":{"sockets":3}}}}}}`)
	_, vmi = e.waitVM("cpu", "edit observed", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm.Status.ObservedGeneration == vm.Generation
	})
	if sockets(vmi) != 2 {
		t.Errorf("vmi sockets %d while the node still plugged the last change", sockets(vmi))
	}
	e.setVCPUChange("cpu", false)
	e.waitVM("cpu", "3 sockets on the vmi", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return sockets(vmi) == 3
	})

	for _, c := range []struct{ sockets, want string }{{"2", msgSocketsReduction}, {"5", msgSocketsAboveMax}} {
		e.patchVM("cpu", `{"spec":{"template":{"spec":{"domain":{"cpu":{"sockets":`+c.sockets+`}}}}}}`)
		vm, vmi = e.waitVM("cpu", "restart required for "+c.sockets+" sockets", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
			msg, _ := restartRequired(vm)
			return msg == c.want
		})
		if sockets(vmi) != 3 {
			t.Errorf("%s sockets reached the vmi: %d", c.sockets, sockets(vmi))
		}
	}
	e.patchVM("cpu", `{"spec":{"template":{"spec":{"domain":{"cpu":{"sockets":3}}}}}}`)
	e.waitVM("cpu", "nothing to restart for", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		_, ok := restartRequired(vm)
		return !ok
	})
}

// Under Stage, a VMI gets no maxSockets and a sockets change waits for
// the restart.
func TestCPUChangeStaged(t *testing.T) {
	cluster := &live.Value[rollout.Cluster]{}
	cluster.Set(rollout.Cluster{Stage: true})
	e := setup(t, func(c *Config) { c.Rollout = cluster })
	vmi := e.runningVM("staged-cpu")
	if vmi.Spec.Domain.CPU == nil || vmi.Spec.Domain.CPU.MaxSockets != 0 {
		t.Errorf("vmi cpu %+v under Stage, want no maxSockets", vmi.Spec.Domain.CPU)
	}
	e.patchVM("staged-cpu", `{"spec":{"template":{"spec":{"domain":{"cpu":{"sockets":2}}}}}}`)
	_, vmi = e.waitVM("staged-cpu", "restart required", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		msg, _ := restartRequired(vm)
		return msg == msgRestartRequired
	})
	if sockets(vmi) != 1 {
		t.Errorf("vmi sockets %d under Stage", sockets(vmi))
	}
}

// A VMI started before the start digest left the CPU sockets out keeps
// its meaning: a sockets change is a change of what it started with.
func TestLegacyStartDigest(t *testing.T) {
	vm := &kubevirtv1.VirtualMachine{Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
		Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{CPU: &kubevirtv1.CPU{Sockets: 1}}}}}}
	legacy := specDigest(vm, vm.Spec.Template.Spec.DeepCopy())
	current := startDigest(vm)
	if startChanged(vm, legacy) || startChanged(vm, current) {
		t.Fatal("an unchanged VM reads as changed")
	}
	vm.Spec.Template.Spec.Domain.CPU.Sockets = 2
	if !startChanged(vm, legacy) {
		t.Error("a sockets change is not a change for a VMI of the bare digest")
	}
	if startChanged(vm, current) {
		t.Error("a sockets change is a restart-only change in the current digest")
	}
	vm.Spec.Template.Spec.Domain.CPU.Cores = 2
	if !startChanged(vm, current) {
		t.Error("a cores change is not a restart-only change")
	}
}
