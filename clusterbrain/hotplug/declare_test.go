package hotplug

import (
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

func pvc(name, claim string, hot bool) kubevirtv1.Volume {
	return kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
		Hotpluggable: hot, PersistentVolumeClaimVolumeSource: corePVC(claim)}}}
}

func disk(name string, bus kubevirtv1.DiskBus) kubevirtv1.Disk {
	return kubevirtv1.Disk{Name: name, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: bus}}}
}

func spec(disks []kubevirtv1.Disk, vols ...kubevirtv1.Volume) *kubevirtv1.VirtualMachineInstanceSpec {
	s := &kubevirtv1.VirtualMachineInstanceSpec{Volumes: vols}
	s.Domain.Devices.Disks = disks
	return s
}

func names(s *kubevirtv1.VirtualMachineInstanceSpec) (vols, disks []string) {
	for _, v := range s.Volumes {
		vols = append(vols, v.Name)
	}
	for _, d := range s.Domain.Devices.Disks {
		disks = append(disks, d.Name)
	}
	return vols, disks
}

func TestDeclare(t *testing.T) {
	root := pvc("root", "root", false)
	rootDisk := disk("root", kubevirtv1.DiskBusVirtio)
	vmi := &kubevirtv1.VirtualMachineInstance{Spec: *spec([]kubevirtv1.Disk{rootDisk, disk("old", Bus), disk("same", Bus)},
		root, pvc("old", "old", true), pvc("same", "same", true))}
	template := spec([]kubevirtv1.Disk{rootDisk, disk("same", Bus), disk("new", ""), disk("virt", kubevirtv1.DiskBusVirtio)},
		root, pvc("same", "same", true), pvc("new", "new", true), pvc("nodisk", "nodisk", true), pvc("virt", "virt", true),
		pvc("cold", "cold", false))
	p := Declare(template, vmi)
	vols, disks := names(p.Spec)
	if !slices.Equal(vols, []string{"root", "same", "new", "nodisk"}) || !slices.Equal(disks, []string{"root", "same", "new", "nodisk"}) {
		t.Errorf("volumes %v disks %v", vols, disks)
	}
	if !slices.Equal(p.Remove, []string{"old"}) || len(p.Add) != 2 || p.Add[0].Name != "new" || p.Add[1].Name != "nodisk" {
		t.Errorf("add %v remove %v", p.Add, p.Remove)
	}
	for _, d := range p.Spec.Domain.Devices.Disks[2:] {
		if d.Disk == nil || d.Disk.Bus != Bus {
			t.Errorf("disk %s plugged as %+v", d.Name, d.DiskDevice)
		}
	}
	if len(p.NotLive) != 1 || !strings.Contains(p.NotLive[0], "volume virt") || !strings.Contains(p.NotLive[0], "virtio") {
		t.Errorf("not live %v", p.NotLive)
	}
	if len(vmi.Spec.Volumes) != 3 {
		t.Error("Declare changed the VMI it was given")
	}

	// A volume still reported (being unplugged) is not added back yet; a
	// changed one is removed first.
	vmi.Status.VolumeStatus = []kubevirtv1.VolumeStatus{{Name: "new"}}
	template = spec([]kubevirtv1.Disk{rootDisk, disk("same", Bus), disk("new", Bus)}, root, pvc("same", "other", true), pvc("new", "new", true),
		pvc("old", "old", true))
	p = Declare(template, vmi)
	if vols, _ := names(p.Spec); !slices.Equal(vols, []string{"root", "old"}) || !slices.Equal(p.Remove, []string{"same"}) || len(p.Add) != 0 {
		t.Errorf("volumes %v add %v remove %v", vols, p.Add, p.Remove)
	}

	// Nothing to do.
	if p := Declare(&vmi.Spec, vmi); p.Spec != nil || p.NotLive != nil {
		t.Errorf("plan for an unchanged VMI: %+v", p)
	}
}

func corePVC(claim string) corev1.PersistentVolumeClaimVolumeSource {
	return corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}
}
