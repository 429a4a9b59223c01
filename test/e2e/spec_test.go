package e2e

import (
	"context"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/guest"
)

// The guest every test boots: the extlinux-bootable disk of test/guest,
// whose init prints NODEVIRT-... markers on ttyS0 and leaves a root shell
// there. Each VMI gets a private sparse copy as a hostDisk, which needs no
// registry or import (KubeVirt's conformance tests use containerDisks: those
// have their own test, TestContainerDisk, as imported disks have
// TestDataVolumeImport).
var (
	bootDiskOnce sync.Once
	bootDiskPath string
	bootDiskErr  error
)

func bootDisk() (string, error) {
	bootDiskOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		bootDiskPath, bootDiskErr = guest.BootDisk(ctx, guest.DiskSpec{})
	})
	return bootDiskPath, bootDiskErr
}

// guestMemory is what each guest gets: enough for the cloud kernel and a
// busybox initramfs, small enough to run many at once.
const guestMemory = "128Mi"

type vmiOption func(*kubevirtv1.VirtualMachineInstanceSpec)

// withUserData adds a NoCloud seed with inline user-data.
func withUserData(userData string) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		addCloudInit(s, &kubevirtv1.CloudInitNoCloudSource{UserData: userData})
	}
}

// withUserDataSecret adds a NoCloud seed whose user-data is in a Secret.
func withUserDataSecret(secret string) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		addCloudInit(s, &kubevirtv1.CloudInitNoCloudSource{UserDataSecretRef: &corev1.LocalObjectReference{Name: secret}})
	}
}

func addCloudInit(s *kubevirtv1.VirtualMachineInstanceSpec, src *kubevirtv1.CloudInitNoCloudSource) {
	s.Domain.Devices.Disks = append(s.Domain.Devices.Disks, kubevirtv1.Disk{Name: "cloudinit",
		DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}})
	s.Volumes = append(s.Volumes, kubevirtv1.Volume{Name: "cloudinit",
		VolumeSource: kubevirtv1.VolumeSource{CloudInitNoCloud: src}})
}

// withBridge adds a NIC with the bridge binding on a Multus network.
func withBridge(nad string) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.Domain.Devices.Interfaces = append(s.Domain.Devices.Interfaces, kubevirtv1.Interface{Name: "net1",
			InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Bridge: &kubevirtv1.InterfaceBridge{}}})
		s.Networks = append(s.Networks, kubevirtv1.Network{Name: "net1",
			NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: nad}}})
	}
}

func withStartPaused() vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		p := kubevirtv1.StartStrategyPaused
		s.StartStrategy = &p
	}
}

func withGracePeriod(seconds int64) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.TerminationGracePeriodSeconds = &seconds }
}

// vmiSpec is the spec of a test guest: 128 MiB, the boot disk at diskPath
// as a virtio hostDisk, the serial console logged, no pod network (nodevirt
// has none), a 10 s grace period.
func vmiSpec(diskPath string, opts ...vmiOption) kubevirtv1.VirtualMachineInstanceSpec {
	grace := int64(10)
	yes, no := true, false
	s := kubevirtv1.VirtualMachineInstanceSpec{
		TerminationGracePeriodSeconds: &grace,
		Domain: kubevirtv1.DomainSpec{
			Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceMemory: resource.MustParse(guestMemory)}},
			Devices: kubevirtv1.Devices{
				AutoattachPodInterface: &no,
				LogSerialConsole:       &yes,
				Disks: []kubevirtv1.Disk{{Name: "rootdisk",
					DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}}},
			},
		},
		Volumes: []kubevirtv1.Volume{{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{
			HostDisk: &kubevirtv1.HostDisk{Path: diskPath, Type: kubevirtv1.HostDiskExists}}}},
	}
	for _, o := range opts {
		o(&s)
	}
	return s
}

// guestDisk makes the private boot disk of one VM.
func (n *testNS) guestDisk(vm string) string {
	n.t.Helper()
	src, err := bootDisk()
	if err != nil {
		n.t.Fatalf("guest image: %v", err)
	}
	dst := n.e.path("disks", n.name, vm+".raw")
	if err := copyDisk(src, dst); err != nil {
		n.t.Fatal(err)
	}
	return dst
}

// newVMI returns a test guest VMI (not created).
func (n *testNS) newVMI(name string, opts ...vmiOption) *kubevirtv1.VirtualMachineInstance {
	n.t.Helper()
	return &kubevirtv1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.name},
		Spec:       vmiSpec(n.guestDisk(name), opts...),
	}
}

// newVM returns a test guest VM with the given run strategy (not created).
func (n *testNS) newVM(name string, rs kubevirtv1.VirtualMachineRunStrategy, opts ...vmiOption) *kubevirtv1.VirtualMachine {
	n.t.Helper()
	return &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.name},
		Spec: kubevirtv1.VirtualMachineSpec{
			RunStrategy: &rs,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"e2e/vm": name}},
				Spec:       vmiSpec(n.guestDisk(name), opts...),
			},
		},
	}
}
