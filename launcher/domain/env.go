// Package domain turns a KubeVirt VirtualMachineInstance into a libvirt domain
// definition (libvirtxml types, never hand-written XML) and prepares the
// per-VM files that definition refers to (empty disks, ephemeral overlays,
// cloud-init seeds).
//
// The package never touches netlink, storage pools or the Kubernetes API:
// everything the node knows (where a volume's image lives, which tap device a
// NIC uses, the contents of referenced Secrets) comes in through Env.
package domain

import (
	"errors"
	"fmt"
	"path/filepath"
)

// Format is a disk image format as libvirt names it.
type Format string

const (
	// FormatRaw is a plain image or a block device.
	FormatRaw Format = "raw"
	// FormatQcow2 is a qcow2 image.
	FormatQcow2 Format = "qcow2"
)

// DiskSource says where a volume's disk image lives on this node.
type DiskSource struct {
	// Path of the image file, or of the block device when Block is set.
	Path string
	// Block tells that Path is a block device.
	Block bool
	// Format of the image; empty means raw.
	Format Format
}

// DefaultOVMFDir is where Debian's ovmf package installs UEFI firmware.
const DefaultOVMFDir = "/usr/share/OVMF"

// DefaultMemoryOverhead is what a memory limit grows by before it becomes the
// domain's hard limit: QEMU needs memory beyond the guest's own (device
// emulation, TCG translation cache, I/O buffers), as KubeVirt adds an overhead
// to the virt-launcher pod's limit.
const DefaultMemoryOverhead = 256 << 20

// Env is what the node supplies for one VMI.
type Env struct {
	// Emulation selects TCG (domain type qemu) instead of KVM.
	Emulation bool
	// StateDir is the VM's own directory on the node (empty disks, overlays,
	// cloud-init seeds, NVRAM and the serial log live there). It must be
	// reachable by the user QEMU runs as. Required.
	StateDir string
	// Disks maps a volume name (spec.volumes[].name) to its image, for
	// persistentVolumeClaim, dataVolume, ephemeral and hostDisk volumes (the
	// file the node resolved inside its host disk root), and to the
	// pulled image (read-only, the backing of an overlay) for containerDisk
	// volumes.
	Disks map[string]DiskSource
	// Taps maps an interface name (spec.domain.devices.interfaces[].name) to
	// the tap the node attached for it.
	Taps map[string]Tap
	// Secrets holds the data of the Secrets the VMI refers to, by Secret name
	// then key (secret volumes, cloud-init secretRef and
	// networkDataSecretRef).
	Secrets map[string]map[string][]byte
	// ConfigMaps holds the data of the ConfigMaps the VMI's configMap
	// volumes refer to, by name then key.
	ConfigMaps map[string]map[string][]byte
	// Emulator is the QEMU binary; empty lets libvirt choose.
	Emulator string
	// OVMFDir holds the UEFI firmware; empty means DefaultOVMFDir.
	OVMFDir string
	// MemoryOverhead is added to resources.limits.memory to make the domain's
	// memtune hard limit; 0 means DefaultMemoryOverhead.
	MemoryOverhead int64
}

// Tap is what the node made for one interface (the result of
// cni/bridge.AttachTap, or of the pod network's attach), and all the domain
// takes from the host side of a NIC: the interface's target is Dev; the
// guest's MAC is MAC, the address the port's spoof-check rules and the pod
// network's lease were made for, and must agree with the spec's when the
// spec names one; the guest's link MTU is MTU (<mtu size=>, so the guest
// sees the bridge's MTU, not 1500), 0 leaving QEMU's default.
type Tap struct {
	Dev string
	MAC string
	MTU int
}

func (e *Env) defaulted() Env {
	out := *e
	if out.OVMFDir == "" {
		out.OVMFDir = DefaultOVMFDir
	}
	if out.MemoryOverhead == 0 {
		out.MemoryOverhead = DefaultMemoryOverhead
	}
	return out
}

func (e *Env) validate() error {
	if e.StateDir == "" {
		return errors.New("env: state dir is not set")
	}
	if !filepath.IsAbs(e.StateDir) {
		return fmt.Errorf("env: state dir %q is not an absolute path", e.StateDir)
	}
	for name, d := range e.Disks {
		if d.Path == "" {
			return fmt.Errorf("env: disk for volume %q has no path", name)
		}
		switch d.Format {
		case "", FormatRaw, FormatQcow2:
		default:
			return fmt.Errorf("env: disk for volume %q: unknown format %q", name, d.Format)
		}
		if d.Block && d.Format == FormatQcow2 {
			// qcow2 on a block device is legal for libvirt, but our pools never
			// produce it; refuse rather than guess.
			return fmt.Errorf("env: disk for volume %q: qcow2 on a block device is not supported", name)
		}
	}
	return nil
}

// Paths of the files the domain uses inside Env.StateDir.

// EmptyDiskPath is where the emptyDisk volume's qcow2 image is created.
func (e *Env) EmptyDiskPath(volume string) string {
	return filepath.Join(e.StateDir, "emptydisk-"+volume+".qcow2")
}

// EphemeralPath is where the ephemeral volume's qcow2 overlay is created.
func (e *Env) EphemeralPath(volume string) string {
	return filepath.Join(e.StateDir, "ephemeral-"+volume+".qcow2")
}

// ContainerDiskPath is where the containerDisk volume's qcow2 overlay on
// the pulled image is created.
func (e *Env) ContainerDiskPath(volume string) string {
	return filepath.Join(e.StateDir, "containerdisk-"+volume+".qcow2")
}

// CloudInitPath is where the cloud-init seed ISO of a volume is built.
func (e *Env) CloudInitPath(volume string) string {
	return filepath.Join(e.StateDir, "cloudinit-"+volume+".iso")
}

// ConfigDiskPath is where the ISO of a configMap or secret volume is built.
func (e *Env) ConfigDiskPath(volume string) string {
	return filepath.Join(e.StateDir, "config-"+volume+".iso")
}

// NVRAMPath is the UEFI variable store of the VM.
func (e *Env) NVRAMPath() string { return filepath.Join(e.StateDir, "nvram.fd") }

// SerialLogPath is where the serial console is logged when
// spec.domain.devices.logSerialConsole is true.
func (e *Env) SerialLogPath() string { return filepath.Join(e.StateDir, "serial.log") }
