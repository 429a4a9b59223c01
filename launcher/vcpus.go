package launcher

import (
	"context"
	"fmt"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"
)

// vcpuFlags change the running domain's vCPUs and its persistent
// definition alike, as hotplugFlags do for devices.
const vcpuFlags = libvirt.DOMAIN_VCPU_LIVE | libvirt.DOMAIN_VCPU_CONFIG

// SetVCPUs makes n of the running domain name's vCPUs present, up to the
// maximum it was defined with (libvirt's setvcpus --live --config: QEMU
// adds or removes vCPU devices, the guest sees them through ACPI; a guest
// must agree to give one up).
func (m *Manager) SetVCPUs(ctx context.Context, name string, n uint) error {
	return m.withDomain(name, func(d *libvirt.Domain) error {
		if err := d.SetVcpusFlags(n, vcpuFlags); err != nil {
			return fmt.Errorf("set %d vcpus of %s: %w", n, name, err)
		}
		return nil
	})
}

// VCPUs are the vCPUs a domain definition has present now and at most.
func VCPUs(dom *libvirtxml.Domain) (current, maximum uint) {
	if dom.VCPU == nil {
		return 1, 1
	}
	current = dom.VCPU.Current
	if current == 0 {
		current = dom.VCPU.Value
	}
	return current, dom.VCPU.Value
}
