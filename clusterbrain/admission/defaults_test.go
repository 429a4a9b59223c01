package admission_test

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
)

// TestDefaultVolumeDisks: a volume that no disk or filesystem names gets a
// virtio disk of its own, as KubeVirt defaults it; named volumes keep
// theirs.
func TestDefaultVolumeDisks(t *testing.T) {
	s := kubevirtv1.VirtualMachineInstanceSpec{
		Domain: kubevirtv1.DomainSpec{Devices: kubevirtv1.Devices{
			Disks:       []kubevirtv1.Disk{{Name: "cd", DiskDevice: kubevirtv1.DiskDevice{CDRom: &kubevirtv1.CDRomTarget{Bus: "sata"}}}},
			Filesystems: []kubevirtv1.Filesystem{{Name: "share", Virtiofs: &kubevirtv1.FilesystemVirtiofs{}}},
		}},
		Volumes: []kubevirtv1.Volume{{Name: "rootdisk"}, {Name: "cd"}, {Name: "share"}, {Name: "cloudinit"}},
	}
	admission.DefaultVMISpec(&s)
	var got []string
	for _, d := range s.Domain.Devices.Disks {
		bus := ""
		if d.Disk != nil {
			bus = string(d.Disk.Bus)
		}
		got = append(got, d.Name+":"+bus)
	}
	want := []string{"cd:", "rootdisk:virtio", "cloudinit:virtio"}
	if len(got) != len(want) {
		t.Fatalf("disks %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("disks %v, want %v", got, want)
		}
	}
}

// TestDefaultsReportChange: the mutator answers without a patch exactly
// when defaulting changes nothing, as for VMIs the VM controller defaulted
// before creating them.
func TestDefaultsReportChange(t *testing.T) {
	s := kubevirtv1.VirtualMachineInstanceSpec{Volumes: []kubevirtv1.Volume{{Name: "root"}}}
	if !admission.DefaultsChange(&s) {
		t.Fatal("a bare spec reported as already defaulted")
	}
	if admission.DefaultsChange(&s) {
		t.Fatalf("defaulting a defaulted spec changed it: %+v", s.Domain)
	}
	s.Domain.CPU.Threads = 0
	if !admission.DefaultsChange(&s) || s.Domain.CPU.Threads != 1 {
		t.Fatal("a cleared thread count was not defaulted again")
	}
}

// TestDefaultContainerDiskPullPolicy: containerDisks without a pull policy
// get the one KubeVirt writes (Always for latest or no tag); a policy the
// spec gives is kept.
func TestDefaultContainerDiskPullPolicy(t *testing.T) {
	cases := map[string]corev1.PullPolicy{
		"quay.io/containerdisks/fedora":             corev1.PullAlways,
		"quay.io/containerdisks/fedora:latest":      corev1.PullAlways,
		"quay.io/containerdisks/fedora:41":          corev1.PullIfNotPresent,
		"registry:5000/disks/cirros":                corev1.PullAlways,
		"registry:5000/disks/cirros:6.2":            corev1.PullIfNotPresent,
		"cirros@sha256:" + strings.Repeat("ab", 32): corev1.PullIfNotPresent,
	}
	for image, want := range cases {
		s := kubevirtv1.VirtualMachineInstanceSpec{Volumes: []kubevirtv1.Volume{{Name: "root",
			VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: image}}}}}
		admission.DefaultVMISpec(&s)
		if got := s.Volumes[0].ContainerDisk.ImagePullPolicy; got != want {
			t.Errorf("%s: pull policy %q, want %q", image, got, want)
		}
	}
	s := kubevirtv1.VirtualMachineInstanceSpec{Volumes: []kubevirtv1.Volume{{Name: "root",
		VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "x:latest", ImagePullPolicy: corev1.PullNever}}}}}
	admission.DefaultVMISpec(&s)
	if got := s.Volumes[0].ContainerDisk.ImagePullPolicy; got != corev1.PullNever {
		t.Errorf("given policy Never became %q", got)
	}
}

// TestDefaultsSettleInOnePass: a memory limit alone becomes the guest size
// and the request at once, so applying the defaults again (the VM
// controller, then the mutating webhook) changes nothing.
func TestDefaultsSettleInOnePass(t *testing.T) {
	s := kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Resources: kubevirtv1.ResourceRequirements{
		Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("96Mi")}}}}
	admission.DefaultVMISpec(&s)
	req := s.Domain.Resources.Requests[corev1.ResourceMemory]
	if s.Domain.Memory == nil || s.Domain.Memory.Guest == nil || s.Domain.Memory.Guest.String() != "96Mi" || req.String() != "96Mi" {
		t.Fatalf("memory %+v, requests %v; want guest and request 96Mi", s.Domain.Memory, s.Domain.Resources.Requests)
	}
	again := *s.DeepCopy()
	admission.DefaultVMISpec(&again)
	if !equality.Semantic.DeepEqual(s, again) {
		t.Errorf("a second pass changed the spec:\n%+v\n%+v", s, again)
	}
}
