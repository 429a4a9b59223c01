package domain

import (
	"errors"
	"fmt"
	"slices"

	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"
)

// Hotpluggable reports whether vol is a hotplugged volume (a claim or a
// DataVolume marked hotpluggable, as the addvolume subresource marks it).
func Hotpluggable(vol *v1.Volume) bool {
	switch s := vol.VolumeSource; {
	case s.PersistentVolumeClaim != nil:
		return s.PersistentVolumeClaim.Hotpluggable
	case s.DataVolume != nil:
		return s.DataVolume.Hotpluggable
	}
	return false
}

// HotplugBus is the bus hotplugged disks use, KubeVirt's default: the
// domain's virtio-scsi controller takes them without a free PCI slot.
const HotplugBus = v1.DiskBusSCSI

// HotplugDisk converts the disk of vmi's hotpluggable volume name for a
// live attach, the way Convert converts it at a start (env.Disks supplies
// its node disk), on the first target name that none of taken (the targets
// of the running domain) uses. Like Convert it is pure and reports every
// field it cannot honour.
func HotplugDisk(vmi *v1.VirtualMachineInstance, name string, env Env, taken []string) (libvirtxml.DomainDisk, error) {
	if err := env.validate(); err != nil {
		return libvirtxml.DomainDisk{}, fmt.Errorf("hotplug %s: %w", name, err)
	}
	spec := vmi.Spec.DeepCopy()
	vi := slices.IndexFunc(spec.Volumes, func(v v1.Volume) bool { return v.Name == name })
	di := slices.IndexFunc(spec.Domain.Devices.Disks, func(d v1.Disk) bool { return d.Name == name })
	switch {
	case vi < 0:
		return libvirtxml.DomainDisk{}, fmt.Errorf("hotplug %s: no volume of that name", name)
	case !Hotpluggable(&spec.Volumes[vi]):
		return libvirtxml.DomainDisk{}, &FieldError{Path: fmt.Sprintf("spec.volumes[%d]", vi), Reason: "is not hotpluggable"}
	case di < 0:
		return libvirtxml.DomainDisk{}, &FieldError{Path: "spec.domain.devices.disks", Reason: fmt.Sprintf("no disk for hotplugged volume %q", name)}
	}
	disk := spec.Domain.Devices.Disks[di]
	path := fmt.Sprintf("spec.domain.devices.disks[%d]", di)
	switch {
	case disk.Disk != nil && disk.Disk.Bus != HotplugBus:
		return libvirtxml.DomainDisk{}, &FieldError{Path: path + ".disk.bus", Reason: fmt.Sprintf("a hotplugged disk must use the %s bus, not %q", HotplugBus, disk.Disk.Bus), Unsupported: true}
	case disk.Disk == nil && disk.LUN == nil:
		return libvirtxml.DomainDisk{}, &FieldError{Path: path, Reason: "a hotplugged volume must be a disk or a lun", Unsupported: true}
	case disk.BootOrder != nil:
		return libvirtxml.DomainDisk{}, &FieldError{Path: path + ".bootOrder", Reason: "a hotplugged disk cannot be booted from", Unsupported: true}
	}
	spec.Volumes = []v1.Volume{spec.Volumes[vi]}
	spec.Domain.Devices.Disks = []v1.Disk{disk}
	one := vmi.DeepCopy()
	one.Spec = *spec
	c := &converter{vmi: one, spec: spec, env: env.defaulted(), vcpus: 1}
	d := &libvirtxml.Domain{Devices: &libvirtxml.DomainDeviceList{}}
	c.disks(d)
	if len(c.errs) > 0 {
		return libvirtxml.DomainDisk{}, fmt.Errorf("hotplug %s: %w", name, errors.Join(c.errs...))
	}
	out := d.Devices.Disks[0]
	for i := 0; ; i++ {
		if t := targetName("sd", i); !slices.Contains(taken, t) {
			out.Target.Dev = t
			break
		}
	}
	return out, nil
}
