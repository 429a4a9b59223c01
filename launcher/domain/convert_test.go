package domain

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"
	"sigs.k8s.io/yaml"
)

var update = flag.Bool("update", false, "rewrite the golden domain XML files")

// LoadVMI reads a VMI manifest.
func loadVMI(t *testing.T, path string) *v1.VirtualMachineInstance {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	vmi := &v1.VirtualMachineInstance{}
	if err := yaml.UnmarshalStrict(b, vmi); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return vmi
}

// testEnv is the node side of the golden tests: images under a pool
// directory (or /dev/nodevirt for volumes listed in the
// nodevirt-test/block-volumes annotation), one tap per interface.
func testEnv(vmi *v1.VirtualMachineInstance) Env {
	block := map[string]bool{}
	for _, v := range strings.Split(vmi.Annotations["nodevirt-test/block-volumes"], ",") {
		block[v] = true
	}
	env := Env{
		Emulation: vmi.Annotations["nodevirt-test/kvm"] != "true",
		StateDir:  "/var/lib/nodevirt/vms/" + Name(vmi.Namespace, vmi.Name),
		Disks:     map[string]DiskSource{},
		Taps:      map[string]Tap{},
	}
	for _, v := range vmi.Spec.Volumes {
		claim := ""
		switch {
		case v.PersistentVolumeClaim != nil:
			claim = v.PersistentVolumeClaim.ClaimName
		case v.DataVolume != nil:
			claim = v.DataVolume.Name
		case v.Ephemeral != nil:
			claim = v.Ephemeral.PersistentVolumeClaim.ClaimName
		case v.HostDisk != nil:
			// The node agent resolved it inside its host disk root.
			env.Disks[v.Name] = DiskSource{Path: v.HostDisk.Path, Format: FormatRaw}
			continue
		case v.ContainerDisk != nil:
			// The node agent's image cache.
			env.Disks[v.Name] = DiskSource{Path: "/var/lib/nodevirt/vms/containerdisks/images/" + v.Name + "/disk.img", Format: FormatRaw}
			continue
		default:
			continue
		}
		if block[v.Name] {
			env.Disks[v.Name] = DiskSource{Path: "/dev/nodevirt/" + claim, Block: true}
		} else {
			env.Disks[v.Name] = DiskSource{Path: "/var/lib/nodevirt/pool/" + claim + "/disk.img", Format: FormatRaw}
		}
	}
	for i, iface := range vmi.Spec.Domain.Devices.Interfaces {
		env.Taps[iface.Name] = Tap{Dev: "nvtap" + string(rune('0'+i))}
	}
	return env
}

func TestGolden(t *testing.T) {
	manifests, err := filepath.Glob("testdata/*.yaml")
	if err != nil || len(manifests) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	for _, m := range manifests {
		t.Run(filepath.Base(m), func(t *testing.T) {
			vmi := loadVMI(t, m)
			d, err := Convert(vmi, testEnv(vmi))
			if err != nil {
				t.Fatal(err)
			}
			got, err := d.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			golden := strings.TrimSuffix(m, ".yaml") + ".xml"
			if *update {
				if err := os.WriteFile(golden, []byte(got+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with -update to create)", err)
			}
			if got+"\n" != string(want) {
				t.Errorf("domain of %s differs from %s (run with -update after checking):\n%s", m, golden, got)
			}

			// Round trip: what libvirtxml reads back marshals the same.
			var back libvirtxml.Domain
			if err := back.Unmarshal(string(want)); err != nil {
				t.Fatal(err)
			}
			again, err := back.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			if again+"\n" != string(want) {
				t.Errorf("round trip of %s changed it:\n%s", golden, again)
			}
			md, ok, err := MetadataOf(&back)
			if err != nil || !ok {
				t.Fatalf("metadata of %s: ok=%v err=%v", golden, ok, err)
			}
			if md.UID != string(vmi.UID) || md.Namespace != vmi.Namespace || md.Name != vmi.Name {
				t.Errorf("metadata %+v does not name %s/%s %s", md, vmi.Namespace, vmi.Name, vmi.UID)
			}
		})
	}
}

func TestGoldenSpecifics(t *testing.T) {
	vmi := loadVMI(t, "testdata/full.yaml")
	d, err := Convert(vmi, testEnv(vmi))
	if err != nil {
		t.Fatal(err)
	}
	if d.Type != "kvm" || d.Name != "prod_web-1" || d.UUID != "5d9a1f1e-7c2b-4a39-9f0e-6b8c2d4e1a7f" {
		t.Errorf("type/name/uuid = %s/%s/%s", d.Type, d.Name, d.UUID)
	}
	if d.VCPU.Value != 4 || d.CPU.Topology.Cores != 2 || d.CPU.Topology.Threads != 2 {
		t.Errorf("vcpus %d topology %+v", d.VCPU.Value, d.CPU.Topology)
	}
	md, _, _ := MetadataOf(d)
	if d.Memory.Value != 1<<20 || md.MemoryHardLimitKiB != (2<<20)+(DefaultMemoryOverhead>>10) || d.MemoryTune != nil {
		t.Errorf("memory %d KiB, hard limit %d KiB", d.Memory.Value, md.MemoryHardLimitKiB)
	}
	if d.CPUTune.GlobalQuota.Value != 200000 || d.CPUTune.Shares.Value != 512 {
		t.Errorf("cputune %+v %+v", d.CPUTune.GlobalQuota, d.CPUTune.Shares)
	}
	targets := map[string]string{}
	for _, disk := range d.Devices.Disks {
		targets[disk.Alias.Name] = disk.Target.Dev + "/" + disk.Target.Bus
	}
	want := map[string]string{
		"ua-root": "vda/virtio", "ua-data": "sda/scsi", "ua-scratch": "sdb/sata", "ua-overlay": "vdb/virtio",
		"ua-install": "sdc/sata", "ua-shared": "vdc/virtio", "ua-cloudinit": "vdd/virtio",
	}
	for k, v := range want {
		if targets[k] != v {
			t.Errorf("disk %s target %q, want %q", k, targets[k], v)
		}
	}
	lan := d.Devices.Interfaces[1]
	if lan.MAC.Address != "02:ab:cd:00:00:02" || lan.Target.Dev != "nvtap1" || lan.Target.Managed != "no" || lan.Source.Ethernet == nil {
		t.Errorf("lan interface %+v %+v", lan.MAC, lan.Target)
	}
	if !StartPaused(vmi) {
		t.Error("startStrategy Paused not seen")
	}
}

func TestTargetName(t *testing.T) {
	for i, want := range map[int]string{0: "vda", 25: "vdz", 26: "vdaa", 27: "vdab", 701: "vdzz", 702: "vdaaa"} {
		if got := targetName("vd", i); got != want {
			t.Errorf("targetName(%d) = %s, want %s", i, got, want)
		}
	}
}

func TestRefusals(t *testing.T) {
	tru := true
	cases := []struct {
		name     string
		mutate   func(*v1.VirtualMachineInstance)
		want     string
		unsupMsg bool
	}{
		{"gpus", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.GPUs = []v1.GPU{{Name: "g", DeviceName: "nvidia.com/x"}}
		}, "spec.domain.devices.gpus: not supported", true},
		{"containerDisk path", func(v *v1.VirtualMachineInstance) {
			v.Spec.Volumes[0].VolumeSource = v1.VolumeSource{ContainerDisk: &v1.ContainerDiskSource{Image: "quay.io/x/fedora", Path: "disk/../x.img"}}
		}, `spec.volumes[0].containerDisk.path: "disk/../x.img" is not an absolute, clean path of a file in the image`, false},
		{"containerDisk policy", func(v *v1.VirtualMachineInstance) {
			v.Spec.Volumes[0].VolumeSource = v1.VolumeSource{ContainerDisk: &v1.ContainerDiskSource{Image: "quay.io/x/fedora", ImagePullPolicy: "Sometimes"}}
		}, `spec.volumes[0].containerDisk.imagePullPolicy: unknown policy "Sometimes"`, false},
		{"containerDisk image", func(v *v1.VirtualMachineInstance) {
			v.Spec.Volumes[0].VolumeSource = v1.VolumeSource{ContainerDisk: &v1.ContainerDiskSource{}}
		}, `spec.volumes[0].containerDisk.image: empty`, false},
		{"sriov", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.Interfaces[0].InterfaceBindingMethod = v1.InterfaceBindingMethod{SRIOV: &v1.InterfaceSRIOV{}}
		}, "spec.domain.devices.interfaces[0].sriov: not supported", true},
		{"dedicated", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.CPU = &v1.CPU{DedicatedCPUPlacement: true}
		}, "spec.domain.cpu.dedicatedCpuPlacement: not supported yet", true},
		{"no memory", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Resources.Requests = nil
		}, "spec.domain.memory.guest: guest memory is not set", false},
		{"guest over limit", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Resources.Limits = k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("32Mi")}
		}, "exceeds resources.limits.memory", false},
		{"disk without volume", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.Disks[0].Name = "other"
		}, `spec.domain.devices.disks[0].name: no volume named "other"`, false},
		{"virtio cdrom", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.Disks[0].DiskDevice = v1.DiskDevice{CDRom: &v1.CDRomTarget{Bus: "virtio"}}
		}, "spec.domain.devices.disks[0].cdrom.bus: a cdrom cannot use the virtio bus", false},
		{"bad mac", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.Interfaces[0].MacAddress = "nope"
		}, `spec.domain.devices.interfaces[0].macAddress: "nope" is not a MAC-48 address`, false},
		{"tpm", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.TPM = &v1.TPMDevice{}
		}, "spec.domain.devices.tpm: not supported", true},
		{"vsock", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.AutoattachVSOCK = &tru
		}, "spec.domain.devices.autoattachVSOCK: not supported", true},
		{"efi persistent", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Firmware = &v1.Firmware{Bootloader: &v1.Bootloader{EFI: &v1.EFI{Persistent: &tru}}}
		}, "spec.domain.firmware.bootloader.efi.persistent: not supported yet", true},
		{"secure boot without smm", func(v *v1.VirtualMachineInstance) {
			f := false
			v.Spec.Domain.Firmware = &v1.Firmware{Bootloader: &v1.Bootloader{EFI: &v1.EFI{}}}
			v.Spec.Domain.Features = &v1.Features{SMM: &v1.FeatureState{Enabled: &f}}
		}, "spec.domain.features.smm: EFI secure boot needs SMM", false},
		{"unused volume", func(v *v1.VirtualMachineInstance) {
			v.Spec.Volumes = append(v.Spec.Volumes, v1.Volume{Name: "x", VolumeSource: v1.VolumeSource{
				EmptyDisk: &v1.EmptyDiskSource{Capacity: resource.MustParse("1Mi")}}})
		}, `spec.volumes[1]: volume "x" is not used by any disk`, false},
		{"bad pci address", func(v *v1.VirtualMachineInstance) {
			v.Spec.Domain.Devices.Interfaces[0].PciAddress = "00:1e.0"
		}, `spec.domain.devices.interfaces[0].pciAddress: "00:1e.0" is not a PCI address (dddd:bb:ss.f)`, false},
		{"arm", func(v *v1.VirtualMachineInstance) { v.Spec.Architecture = "arm64" },
			`spec.architecture: "arm64" is not supported (only amd64)`, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			vmi := loadVMI(t, "testdata/minimal.yaml")
			tc.mutate(vmi)
			_, err := Convert(vmi, testEnv(vmi))
			if err == nil {
				t.Fatalf("converted; want error %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
			if got := errors.Is(err, ErrNotSupported); got != tc.unsupMsg {
				t.Errorf("errors.Is(err, ErrNotSupported) = %v, want %v", got, tc.unsupMsg)
			}
			var fe *FieldError
			if tc.unsupMsg && (!errors.As(err, &fe) || !fe.Unsupported) {
				t.Errorf("no unsupported *FieldError in %v", err)
			}
		})
	}
}

func TestNodeMissingParts(t *testing.T) {
	vmi := loadVMI(t, "testdata/minimal.yaml")
	env := testEnv(vmi)
	delete(env.Taps, "lan")
	delete(env.Disks, "root")
	_, err := Convert(vmi, env)
	for _, want := range []string{
		`spec.domain.devices.interfaces[0]: no tap device for interface "lan" on this node`,
		`spec.volumes[0].persistentVolumeClaim: no disk image for volume "root" on this node`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v does not contain %q", err, want)
		}
	}
}

func TestContainerDiskOverlay(t *testing.T) {
	vmi := loadVMI(t, "testdata/containerdisk.yaml")
	env := testEnv(vmi)
	d, err := Convert(vmi, env)
	if err != nil {
		t.Fatal(err)
	}
	for i, vol := range []string{"containerdisk", "tools"} {
		disk := d.Devices.Disks[i]
		if disk.Source.File.File != env.ContainerDiskPath(vol) || disk.Driver.Type != "qcow2" || disk.ReadOnly != nil {
			t.Errorf("disk %s: source %s format %s, want a writable qcow2 overlay at %s",
				vol, disk.Source.File.File, disk.Driver.Type, env.ContainerDiskPath(vol))
		}
	}
	delete(env.Disks, "tools")
	if _, err := Convert(vmi, env); err == nil ||
		!strings.Contains(err.Error(), `spec.volumes[1].containerDisk: no disk image for volume "tools" on this node`) {
		t.Errorf("conversion without the pulled image: %v", err)
	}
}

func TestAllRefusalsAtOnce(t *testing.T) {
	vmi := loadVMI(t, "testdata/minimal.yaml")
	vmi.Spec.Domain.Devices.GPUs = []v1.GPU{{Name: "g"}}
	vmi.Spec.Domain.Devices.Filesystems = []v1.Filesystem{{Name: "f"}}
	_, err := Convert(vmi, testEnv(vmi))
	if err == nil || !strings.Contains(err.Error(), "devices.gpus") || !strings.Contains(err.Error(), "devices.filesystems") {
		t.Fatalf("want both refusals, got %v", err)
	}
}

func TestParseMetadataAsLibvirtWritesIt(t *testing.T) {
	// libvirt returns the element with its own prefix.
	in := `<nodevirt:vmi xmlns:nodevirt="` + MetadataNamespace + `" uid="u-1" namespace="ns" name="n"/>`
	m, ok, err := ParseMetadata(in)
	if err != nil || !ok || m.UID != "u-1" || m.Namespace != "ns" || m.Name != "n" {
		t.Fatalf("got %+v ok=%v err=%v", m, ok, err)
	}
	if _, ok, _ := ParseMetadata(`<other xmlns="urn:x" uid="u"/>`); ok {
		t.Fatal("foreign element taken for nodevirt metadata")
	}
	ns, name, ok := SplitName(Name("default", "vm-1"))
	if !ok || ns != "default" || name != "vm-1" {
		t.Fatalf("SplitName: %s %s %v", ns, name, ok)
	}
}

func TestEnvValidation(t *testing.T) {
	vmi := loadVMI(t, "testdata/minimal.yaml")
	env := testEnv(vmi)
	env.StateDir = "relative"
	if _, err := Convert(vmi, env); err == nil || !strings.Contains(err.Error(), "not an absolute path") {
		t.Fatalf("relative state dir accepted: %v", err)
	}
	env = testEnv(vmi)
	env.Disks["root"] = DiskSource{Path: "/x", Format: "vmdk"}
	if _, err := Convert(vmi, env); err == nil || !strings.Contains(err.Error(), `unknown format "vmdk"`) {
		t.Fatalf("vmdk accepted: %v", err)
	}
}

// The tap the node attached is what the NIC gets: its device, its MTU
// (<mtu size=>, so the guest's link matches the bridge's) and, when the
// spec names no MAC, the MAC the port was made for; a spec MAC the tap was
// not made for is refused.
func TestTapFeedsInterface(t *testing.T) {
	vmi := loadVMI(t, "testdata/minimal.yaml")
	vmi.Spec.Domain.Devices.Interfaces[0].MacAddress = ""
	env := testEnv(vmi)
	env.Taps["lan"] = Tap{Dev: "nvtlan", MAC: "02:aa:bb:cc:dd:ee", MTU: 1400}
	d, err := Convert(vmi, env)
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Devices.Interfaces) != 1 {
		t.Fatalf("interfaces %+v", d.Devices.Interfaces)
	}
	got := d.Devices.Interfaces[0]
	if got.Target == nil || got.Target.Dev != "nvtlan" {
		t.Errorf("target %+v, want nvtlan", got.Target)
	}
	if got.MTU == nil || got.MTU.Size != 1400 {
		t.Errorf("mtu %+v, want 1400", got.MTU)
	}
	if got.MAC == nil || got.MAC.Address != "02:aa:bb:cc:dd:ee" {
		t.Errorf("mac %+v, want the tap's 02:aa:bb:cc:dd:ee", got.MAC)
	}
	x, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(x, `<mtu size="1400"></mtu>`) {
		t.Errorf("domain XML lacks the MTU:\n%s", x)
	}

	vmi.Spec.Domain.Devices.Interfaces[0].MacAddress = "02:00:00:00:00:01"
	if _, err := Convert(vmi, env); err == nil || !strings.Contains(err.Error(), "tap nvtlan was attached for MAC 02:aa:bb:cc:dd:ee, not the spec's 02:00:00:00:00:01") {
		t.Errorf("a tap made for another MAC: %v", err)
	}
	env.Taps["lan"] = Tap{Dev: "nvtlan"}
	d, err = Convert(vmi, env)
	if err != nil {
		t.Fatal(err)
	}
	if i := d.Devices.Interfaces[0]; i.MTU != nil || i.MAC == nil || i.MAC.Address != "02:00:00:00:00:01" {
		t.Errorf("a tap without MTU or MAC: mtu %+v mac %+v", i.MTU, i.MAC)
	}
}
