package e2e

import (
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestCPUHotplug raises a running VM's CPU sockets with the lab's
// HyperConverged defaults (vmRolloutStrategy LiveUpdate): the VMI was
// started with maxSockets 4 (KubeVirt's hotplug ratio), the node agent
// plugs the vCPU into the live domain, the guest sees a second CPU and
// brings it online, status.currentCPUTopology follows, and no restart is
// asked for; more sockets than maxSockets set RestartRequired, cleared
// when the template asks for what runs again.
func TestCPUHotplug(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	const vm = "cpuhp"
	n.createVM(n.newVM(vm, kubevirtv1.RunStrategyAlways, func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.Domain.CPU = &kubevirtv1.CPU{Sockets: 1, Cores: 1, Threads: 1}
	}))
	vmi := n.waitVMIOfVM(vm, 2*time.Minute)
	if got := vmi.Spec.Domain.CPU.MaxSockets; got != 4 {
		t.Fatalf("vmi maxSockets %d, want 4", got)
	}
	n.waitBooted(vm)
	dom, err := domainXML(n.name, vm)
	if err != nil {
		t.Fatal(err)
	}
	if dom.VCPU == nil || dom.VCPU.Value != 4 || dom.VCPU.Current != 1 {
		t.Fatalf("domain vcpu %+v, want 1 of 4", dom.VCPU)
	}
	c := n.console(vm)
	c.login()
	c.send("echo CPUS-$(grep -c ^processor /proc/cpuinfo)\r")
	c.expect(`CPUS-1\b`, time.Minute)

	n.editTemplate(vm, func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.Domain.CPU.Sockets = 2 })
	n.waitVMI(vm, 2*time.Minute, "2 sockets plugged", func(v *kubevirtv1.VirtualMachineInstance) bool {
		if v == nil || v.Status.CurrentCPUTopology == nil || v.Status.CurrentCPUTopology.Sockets != 2 {
			return false
		}
		for _, cond := range v.Status.Conditions {
			if cond.Type == kubevirtv1.VirtualMachineInstanceVCPUChange && cond.Status == corev1.ConditionTrue {
				return false
			}
		}
		return true
	})
	if dom, err = domainXML(n.name, vm); err != nil || dom.VCPU == nil || dom.VCPU.Current != 2 {
		t.Errorf("domain vcpu after the hotplug: %+v, %v", dom.VCPU, err)
	}
	if msg := n.restartRequired(vm); msg != "" {
		t.Errorf("RestartRequired %q after a hotplug within maxSockets", msg)
	}
	// The guest sees the new CPU through ACPI and onlines it (udev would).
	c.send("until [ -e /sys/devices/system/cpu/cpu1/online ]; do sleep 1; done; echo 1 > /sys/devices/system/cpu/cpu1/online; echo CPUS-$(grep -c ^processor /proc/cpuinfo)\r")
	c.expect(`CPUS-2\b`, 2*time.Minute)

	n.editTemplate(vm, func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.Domain.CPU.Sockets = 5 })
	n.eventually(time.Minute, "RestartRequired above maxSockets", func() (bool, string) {
		msg := n.restartRequired(vm)
		return msg == "CPU sockets updated in template spec to a value higher than what's available", fmt.Sprintf("RestartRequired %q", msg)
	})
	if got, err := n.getVMI(vm); err != nil || got.Spec.Domain.CPU.Sockets != 2 {
		t.Errorf("vmi after a change above maxSockets: %v", err)
	}
	n.editTemplate(vm, func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.Domain.CPU.Sockets = 2 })
	n.eventually(time.Minute, "RestartRequired cleared", func() (bool, string) {
		msg := n.restartRequired(vm)
		return msg == "", fmt.Sprintf("RestartRequired %q", msg)
	})
}
