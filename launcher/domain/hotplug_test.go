package domain

import (
	"errors"
	"strings"
	"testing"

	k8sv1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"
)

func hotplugVMI(bus v1.DiskBus) *v1.VirtualMachineInstance {
	claim := func(name string, hot bool) v1.VolumeSource {
		return v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{Hotpluggable: hot,
			PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: name}}}
	}
	return &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "vm", UID: "6a1f3c3e-2b7d-4c55-9d6e-0d3c0a1b2c3d"},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{Devices: v1.Devices{Disks: []v1.Disk{
				{Name: "root", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusSCSI}}},
				{Name: "hot", Serial: "hot1", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: bus}}},
			}}},
			Volumes: []v1.Volume{{Name: "root", VolumeSource: claim("root", false)}, {Name: "hot", VolumeSource: claim("data", true)}},
		},
	}
}

// A hotplugged volume converts as at a start, on the first free target of
// the running domain, and only on the SCSI bus; a volume that is not
// hotpluggable is refused.
func TestHotplugDisk(t *testing.T) {
	env := Env{StateDir: "/var/lib/nodevirt/vms/x", Disks: map[string]DiskSource{
		"root": {Path: "/pool/root/disk.img"}, "hot": {Path: "/pool/data/disk.img"}}}
	disk, err := HotplugDisk(hotplugVMI(v1.DiskBusSCSI), "hot", env, []string{"sda", "sdc"})
	if err != nil {
		t.Fatal(err)
	}
	if disk.Target == nil || disk.Target.Dev != "sdb" || disk.Target.Bus != "scsi" {
		t.Errorf("target %+v, want sdb on scsi", disk.Target)
	}
	if disk.Alias == nil || disk.Alias.Name != "ua-hot" || disk.Serial != "hot1" {
		t.Errorf("alias %+v serial %q", disk.Alias, disk.Serial)
	}
	if disk.Source == nil || disk.Source.File == nil || disk.Source.File.File != "/pool/data/disk.img" || disk.Driver.Type != "raw" {
		t.Errorf("source %+v driver %+v", disk.Source, disk.Driver)
	}

	_, err = HotplugDisk(hotplugVMI(v1.DiskBusVirtio), "hot", env, nil)
	var fe *FieldError
	if !errors.As(err, &fe) || !strings.Contains(err.Error(), "must use the scsi bus") || !errors.Is(err, ErrNotSupported) {
		t.Errorf("virtio bus: %v", err)
	}
	if _, err := HotplugDisk(hotplugVMI(v1.DiskBusSCSI), "root", env, nil); err == nil || !strings.Contains(err.Error(), "not hotpluggable") {
		t.Errorf("static volume: %v", err)
	}
	if _, err := HotplugDisk(hotplugVMI(v1.DiskBusSCSI), "gone", env, nil); err == nil {
		t.Error("missing volume converted")
	}
}
