package handler

import (
	"context"
	"fmt"

	k8sv1 "k8s.io/api/core/v1"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// syncVCPUs brings the running domain's vCPUs to the VMI's CPU topology,
// as virt-handler and virt-launcher do for CPU hotplug (the brain's VM
// controller raises the VMI's sockets, up to its maxSockets, when the VM's
// template asks for more): while the domain has other than sockets ×
// cores × threads vCPUs present, out gets the HotVCPUChange condition and
// the node asks libvirt for them live; out's status.currentCPUTopology is
// what the domain has. A VMI without maxSockets was defined with no room
// to grow and is left as it is.
func (h *Handler) syncVCPUs(ctx context.Context, lv *launcher.Manager, vmi, out *v1.VirtualMachineInstance, dom *libvirtxml.Domain) error {
	cpu := vmi.Spec.Domain.CPU
	if cpu == nil {
		return nil
	}
	perSocket := uint(max(cpu.Cores, 1) * max(cpu.Threads, 1))
	current, maximum := launcher.VCPUs(dom)
	want := uint(max(cpu.Sockets, 1)) * perSocket
	if cpu.MaxSockets != 0 && want != current && want <= maximum {
		err := lv.SetVCPUs(ctx, domain.Name(vmi.Namespace, vmi.Name), want)
		if err != nil {
			msg := err.Error()
			if c := conditionOf(vmi, v1.VirtualMachineInstanceVCPUChange); c == nil || c.Message != msg {
				h.recorder.Eventf(vmi, k8sv1.EventTypeWarning, "FailedHotplugCPU", "Failed to hot-plug vCPUs: %v", err)
			}
			setCondition(out, v1.VirtualMachineInstanceVCPUChange, true, "", msg)
			h.log.Warn("cpu hotplug", "vmi", vmi.Namespace+"/"+vmi.Name, "vcpus", want, "err", err)
			return fmt.Errorf("cpu hotplug: %w", err)
		}
		h.log.Info("cpu hotplugged", "vmi", vmi.Namespace+"/"+vmi.Name, "vcpus", want, "was", current)
		h.recorder.Eventf(vmi, k8sv1.EventTypeNormal, "CPUHotplugged", "Hot-plugged vCPUs: %d now, was %d", want, current)
		current = want
	}
	removeCondition(out, v1.VirtualMachineInstanceVCPUChange)
	out.Status.CurrentCPUTopology = &v1.CPUTopology{Sockets: uint32(current / perSocket), Cores: max(cpu.Cores, 1), Threads: max(cpu.Threads, 1)}
	return nil
}
