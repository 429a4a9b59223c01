package hotplug

import (
	"fmt"
	"slices"

	"k8s.io/apimachinery/pkg/api/equality"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Plan is what a VM's template asks of its running VMI's hotplugged
// volumes (KubeVirt's declarative volume hotplug).
type Plan struct {
	// Spec is the VMI's spec with the changes applied; nil when there are
	// none.
	Spec *kubevirtv1.VirtualMachineInstanceSpec
	// Add are the volumes Spec gains (each to be placed first), Remove the
	// names of those it loses.
	Add    []kubevirtv1.Volume
	Remove []string
	// NotLive says, for each hotpluggable template volume that cannot be
	// plugged into a running VMI, why (it is left out of Spec).
	NotLive []string
}

// Declare compares the hotpluggable volumes of template (a VM's
// spec.template.spec) with those of vmi, as KubeVirt's VM controller does
// with the DeclarativeHotplugVolumes gate: a hotpluggable template volume
// the VMI lacks is added with its disk, unless the VMI still reports it
// (an unplug in progress); a hotpluggable VMI volume the template lacks,
// or has changed, is removed with its disk (a changed one comes back on a
// later call, once its unplug is over). Other volumes are left alone: a
// change to them needs a restart.
func Declare(template *kubevirtv1.VirtualMachineInstanceSpec, vmi *kubevirtv1.VirtualMachineInstance) Plan {
	var p Plan
	if !slices.ContainsFunc(template.Volumes, Hotpluggable) && !slices.ContainsFunc(vmi.Spec.Volumes, Hotpluggable) {
		return p // nothing hotplugged either side: the common case, without a copy
	}
	want := map[string]kubevirtv1.Volume{}
	for _, v := range template.Volumes {
		if Hotpluggable(v) {
			want[v.Name] = v
		}
	}
	reported := map[string]bool{}
	for _, s := range vmi.Status.VolumeStatus {
		reported[s.Name] = true
	}
	spec := vmi.Spec.DeepCopy()
	have := map[string]bool{}
	spec.Volumes = slices.DeleteFunc(spec.Volumes, func(v kubevirtv1.Volume) bool {
		have[v.Name] = true
		if !Hotpluggable(v) {
			return false
		}
		if w, ok := want[v.Name]; ok && equality.Semantic.DeepEqual(w, v) {
			return false
		}
		p.Remove = append(p.Remove, v.Name)
		return true
	})
	spec.Domain.Devices.Disks = slices.DeleteFunc(spec.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool {
		return slices.Contains(p.Remove, d.Name)
	})
	for _, v := range template.Volumes {
		if !Hotpluggable(v) || have[v.Name] || reported[v.Name] {
			continue
		}
		disk, why := hotplugDisk(template, v.Name)
		if why != "" {
			p.NotLive = append(p.NotLive, fmt.Sprintf("volume %s: %s", v.Name, why))
			continue
		}
		spec.Volumes = append(spec.Volumes, *v.DeepCopy())
		spec.Domain.Devices.Disks = append(spec.Domain.Devices.Disks, disk)
		p.Add = append(p.Add, *v.DeepCopy())
	}
	if len(p.Add) > 0 || len(p.Remove) > 0 {
		p.Spec = spec
	}
	return p
}

// hotplugDisk is the disk template gives volume name, as it is plugged (a
// SCSI disk when the template has none or leaves the bus out), or why it
// cannot be plugged live.
func hotplugDisk(template *kubevirtv1.VirtualMachineInstanceSpec, name string) (kubevirtv1.Disk, string) {
	i := slices.IndexFunc(template.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool { return d.Name == name })
	if i < 0 {
		return kubevirtv1.Disk{Name: name, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: Bus}}}, ""
	}
	d := *template.Domain.Devices.Disks[i].DeepCopy()
	switch {
	case d.CDRom != nil || d.LUN != nil:
		return d, "only a disk can be hotplugged here, not a cdrom or a lun"
	case d.BootOrder != nil:
		return d, "a hotplugged disk cannot have a boot order"
	case d.Disk == nil:
		d.Disk = &kubevirtv1.DiskTarget{Bus: Bus}
	case d.Disk.Bus == "":
		d.Disk.Bus = Bus
	case d.Disk.Bus != Bus:
		return d, fmt.Sprintf("nodevirt hotplugs disks on the %s bus only, not %q", Bus, d.Disk.Bus)
	}
	return d, ""
}
