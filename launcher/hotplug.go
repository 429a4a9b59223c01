package launcher

import (
	"context"
	"fmt"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"
)

// hotplugFlags change the running domain and its persistent definition
// alike, so a restarted node agent reads back what the guest has.
const hotplugFlags = libvirt.DOMAIN_DEVICE_MODIFY_LIVE | libvirt.DOMAIN_DEVICE_MODIFY_CONFIG

// AttachDisk plugs disk into the running domain name (libvirt live attach;
// QEMU adds the device at once, the guest sees it appear). A disk whose
// alias the domain already has is left as it is.
func (m *Manager) AttachDisk(ctx context.Context, name string, disk libvirtxml.DomainDisk) error {
	doc, err := disk.Marshal()
	if err != nil {
		return fmt.Errorf("attach disk to %s: %w", name, err)
	}
	return m.withDomain(name, func(d *libvirt.Domain) error {
		if disk.Alias != nil {
			if _, found, err := liveDisk(d, disk.Alias.Name); err != nil || found {
				return err
			}
		}
		if err := d.AttachDeviceFlags(doc, hotplugFlags); err != nil {
			return fmt.Errorf("attach disk %s to %s: %w", aliasOf(disk), name, err)
		}
		return nil
	})
}

// DetachDisk unplugs the disk of alias from the running domain name. QEMU
// removes a SCSI disk without the guest's help; a detach libvirt still
// waits for when it returns shows as the disk still being there, and is
// asked again by the caller's next pass. A disk already gone is success.
func (m *Manager) DetachDisk(ctx context.Context, name, alias string) error {
	return m.withDomain(name, func(d *libvirt.Domain) error {
		disk, found, err := liveDisk(d, alias)
		if err != nil || !found {
			return err
		}
		doc, err := disk.Marshal()
		if err != nil {
			return fmt.Errorf("detach disk %s from %s: %w", alias, name, err)
		}
		err = d.DetachDeviceFlags(doc, hotplugFlags)
		if libvirtCode(err) == libvirt.ERR_DEVICE_MISSING || libvirtCode(err) == libvirt.ERR_OPERATION_INVALID {
			// Not in the persistent definition (attached live only by
			// an older agent): detach it from the running guest alone.
			err = d.DetachDeviceFlags(doc, libvirt.DOMAIN_DEVICE_MODIFY_LIVE)
		}
		if err != nil {
			return fmt.Errorf("detach disk %s from %s: %w", alias, name, err)
		}
		return nil
	})
}

// liveDisk finds the disk of alias in the running definition of d.
func liveDisk(d *libvirt.Domain, alias string) (libvirtxml.DomainDisk, bool, error) {
	doc, err := d.GetXMLDesc(0)
	if err != nil {
		return libvirtxml.DomainDisk{}, false, fmt.Errorf("read domain: %w", err)
	}
	var dom libvirtxml.Domain
	if err := dom.Unmarshal(doc); err != nil {
		return libvirtxml.DomainDisk{}, false, fmt.Errorf("parse domain: %w", err)
	}
	if dom.Devices == nil {
		return libvirtxml.DomainDisk{}, false, nil
	}
	for _, disk := range dom.Devices.Disks {
		if disk.Alias != nil && disk.Alias.Name == alias {
			return disk, true, nil
		}
	}
	return libvirtxml.DomainDisk{}, false, nil
}

func aliasOf(disk libvirtxml.DomainDisk) string {
	if disk.Alias != nil {
		return disk.Alias.Name
	}
	if disk.Target != nil {
		return disk.Target.Dev
	}
	return "?"
}
