package domain

import (
	"fmt"
	pathpkg "path"
	"strings"

	k8sv1 "k8s.io/api/core/v1"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"
)

// userAlias is the libvirt user alias of a device named in the spec ("ua-"
// prefix), so that the live domain maps devices back to spec names.
func userAlias(name string) *libvirtxml.DomainAlias {
	if name == "" {
		return nil
	}
	return &libvirtxml.DomainAlias{Name: "ua-" + name}
}

// targetName returns prefix followed by the index in the sd/vd style: a..z, aa..
func targetName(prefix string, i int) string {
	s := ""
	for i++; i > 0; i = (i - 1) / 26 {
		s = string(rune('a'+(i-1)%26)) + s
	}
	return prefix + s
}

// pciAddress parses a PCI address written dddd:bb:ss.f (domain:bus:slot.function, hex).
func (c *converter) pciAddress(path, s string) *libvirtxml.DomainAddress {
	var dom, bus, slot, fn uint
	n, err := fmt.Sscanf(s, "%4x:%2x:%2x.%1x", &dom, &bus, &slot, &fn)
	if err != nil || n != 4 || len(s) != len("0000:00:00.0") || slot > 0x1f || fn > 7 {
		c.invalid(path, "%q is not a PCI address (dddd:bb:ss.f)", s)
		return nil
	}
	return &libvirtxml.DomainAddress{PCI: &libvirtxml.DomainAddressPCI{Domain: &dom, Bus: &bus, Slot: &slot, Function: &fn}}
}

// volumeSource is what a volume contributes to a disk.
type volumeSource struct {
	source   *libvirtxml.DomainDiskSource
	format   Format
	readOnly bool
	block    bool
	share    bool
}

func fileSource(path string) *libvirtxml.DomainDiskSource {
	return &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: path}}
}

func (c *converter) nodeDisk(path, volume string) (volumeSource, bool) {
	ds, ok := c.env.Disks[volume]
	if !ok {
		c.fail(fmt.Errorf("%s: no disk image for volume %q on this node", path, volume))
		return volumeSource{}, false
	}
	vs := volumeSource{format: ds.Format, block: ds.Block}
	if vs.format == "" {
		vs.format = FormatRaw
	}
	if ds.Block {
		vs.source = &libvirtxml.DomainDiskSource{Block: &libvirtxml.DomainDiskSourceBlock{Dev: ds.Path}}
	} else {
		vs.source = fileSource(ds.Path)
	}
	return vs, true
}

func (c *converter) volumeSource(i int, vol *v1.Volume) (volumeSource, bool) {
	path := fmt.Sprintf("spec.volumes[%d]", i)
	s := &vol.VolumeSource
	switch {
	case s.PersistentVolumeClaim != nil:
		vs, ok := c.nodeDisk(path+".persistentVolumeClaim", vol.Name)
		vs.readOnly = s.PersistentVolumeClaim.ReadOnly
		return vs, ok
	case s.DataVolume != nil:
		return c.nodeDisk(path+".dataVolume", vol.Name)
	case s.Ephemeral != nil:
		backing, ok := c.nodeDisk(path+".ephemeral", vol.Name)
		if ok && backing.block {
			c.refuse(path+".ephemeral", "an ephemeral overlay on a block volume is not supported")
		}
		return volumeSource{source: fileSource(c.env.EphemeralPath(vol.Name)), format: FormatQcow2}, ok
	case s.EmptyDisk != nil:
		if s.EmptyDisk.Capacity.Value() <= 0 {
			c.invalid(path+".emptyDisk.capacity", "must be positive")
		}
		return volumeSource{source: fileSource(c.env.EmptyDiskPath(vol.Name)), format: FormatQcow2}, true
	case s.HostDisk != nil:
		hd := s.HostDisk
		switch hd.Type {
		case v1.HostDiskExists:
		case v1.HostDiskExistsOrCreate:
			if hd.Capacity.Value() <= 0 {
				c.invalid(path+".hostDisk.capacity", "must be positive for type DiskOrCreate")
			}
		default:
			c.invalid(path+".hostDisk.type", "unknown type %q", hd.Type)
		}
		if hd.Path == "" {
			c.invalid(path+".hostDisk.path", "empty")
		}
		// The node resolved (and confined) the path: the domain uses the
		// file it opened, never hd.Path as given, always as raw.
		vs, ok := c.nodeDisk(path+".hostDisk", vol.Name)
		if ok && vs.block {
			c.refuse(path+".hostDisk", "a hostDisk must be a file")
		}
		vs.format, vs.share = FormatRaw, hd.Shared != nil && *hd.Shared
		return vs, ok
	case s.CloudInitNoCloud != nil || s.CloudInitConfigDrive != nil:
		return volumeSource{source: fileSource(c.env.CloudInitPath(vol.Name)), format: FormatRaw}, true
	case s.ContainerDisk != nil:
		c.containerDisk(path+".containerDisk", s.ContainerDisk)
		backing, ok := c.nodeDisk(path+".containerDisk", vol.Name)
		if ok && backing.block {
			c.refuse(path+".containerDisk", "a containerDisk image on a block device is not supported")
		}
		return volumeSource{source: fileSource(c.env.ContainerDiskPath(vol.Name)), format: FormatQcow2}, ok
	case s.Sysprep != nil:
		c.refuse(path+".sysprep", "not supported")
	case s.ConfigMap != nil, s.Secret != nil:
		// An ISO holding one file per key, as KubeVirt presents them.
		return volumeSource{source: fileSource(c.env.ConfigDiskPath(vol.Name)), format: FormatRaw, readOnly: true}, true
	case s.DownwardAPI != nil:
		c.refuse(path+".downwardAPI", "not supported")
	case s.ServiceAccount != nil:
		c.refuse(path+".serviceAccount", "not supported")
	case s.DownwardMetrics != nil:
		c.refuse(path+".downwardMetrics", "not supported")
	case s.MemoryDump != nil:
		c.refuse(path+".memoryDump", "not supported")
	case s.ContainerPath != nil:
		c.refuse(path+".containerPath", "not supported")
	default:
		c.invalid(path, "volume %q has no source", vol.Name)
	}
	return volumeSource{}, false
}

func (c *converter) disks(d *libvirtxml.Domain) {
	devs := &c.spec.Domain.Devices
	transitional := devs.UseVirtioTransitional != nil && *devs.UseVirtioTransitional
	volumes := map[string]int{}
	for i, v := range c.spec.Volumes {
		if _, dup := volumes[v.Name]; dup {
			c.invalid(fmt.Sprintf("spec.volumes[%d].name", i), "duplicate volume %q", v.Name)
		}
		volumes[v.Name] = i
	}
	used := map[string]bool{}
	next := map[string]int{} // target prefix -> next index
	for i := range devs.Disks {
		disk := &devs.Disks[i]
		path := fmt.Sprintf("spec.domain.devices.disks[%d]", i)
		vi, ok := volumes[disk.Name]
		if !ok {
			c.invalid(path+".name", "no volume named %q", disk.Name)
			continue
		}
		if used[disk.Name] {
			c.invalid(path+".name", "duplicate disk %q", disk.Name)
			continue
		}
		used[disk.Name] = true
		vs, ok := c.volumeSource(vi, &c.spec.Volumes[vi])
		if !ok {
			continue
		}

		dd := libvirtxml.DomainDisk{
			Source: vs.source,
			Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: string(vs.format)},
			Serial: disk.Serial,
			Alias:  userAlias(disk.Name),
		}
		var bus v1.DiskBus
		readOnly := vs.readOnly
		switch {
		case disk.CDRom != nil:
			dd.Device, bus = "cdrom", disk.CDRom.Bus
			if bus == "" {
				bus = v1.DiskBusSATA
			}
			if bus == v1.DiskBusVirtio {
				c.invalid(path+".cdrom.bus", "a cdrom cannot use the virtio bus")
			}
			if disk.CDRom.ReadOnly != nil && !*disk.CDRom.ReadOnly {
				c.invalid(path+".cdrom.readonly", "a cdrom is always read-only")
			}
			readOnly = true
			switch disk.CDRom.Tray {
			case "", v1.TrayStateClosed:
			case v1.TrayStateOpen:
				dd.Target = &libvirtxml.DomainDiskTarget{Tray: "open"}
			default:
				c.invalid(path+".cdrom.tray", "unknown tray state %q", disk.CDRom.Tray)
			}
		case disk.LUN != nil:
			dd.Device, bus = "lun", disk.LUN.Bus
			if bus == "" {
				bus = v1.DiskBusSCSI
			}
			if bus != v1.DiskBusSCSI {
				c.invalid(path+".lun.bus", "a lun needs the scsi bus")
			}
			if !vs.block {
				c.invalid(path+".lun", "a lun needs a block volume")
			}
			if disk.LUN.Reservation {
				c.refuse(path+".lun.reservation", "not supported")
			}
			readOnly = readOnly || disk.LUN.ReadOnly
		default:
			dd.Device = "disk"
			if disk.Disk != nil {
				bus = disk.Disk.Bus
				readOnly = readOnly || disk.Disk.ReadOnly
				if disk.Disk.PciAddress != "" {
					if bus := disk.Disk.Bus; bus != "" && bus != v1.DiskBusVirtio {
						c.invalid(path+".disk.pciAddress", "only a virtio disk has a PCI address")
					}
					dd.Address = c.pciAddress(path+".disk.pciAddress", disk.Disk.PciAddress)
				}
			}
			if bus == "" {
				bus = v1.DiskBusVirtio
			}
		}

		prefix := "sd"
		switch bus {
		case v1.DiskBusVirtio:
			prefix = "vd"
			if transitional {
				dd.Model = "virtio-transitional"
			}
			if devs.BlockMultiQueue != nil && *devs.BlockMultiQueue {
				q := c.vcpus
				dd.Driver.Queues = &q
			}
		case v1.DiskBusSATA, v1.DiskBusUSB:
		case v1.DiskBusSCSI:
		default:
			c.invalid(path, "unknown bus %q", bus)
		}
		if dd.Target == nil {
			dd.Target = &libvirtxml.DomainDiskTarget{}
		}
		dd.Target.Dev, dd.Target.Bus = targetName(prefix, next[prefix]), string(bus)
		next[prefix]++
		if readOnly {
			dd.ReadOnly = &libvirtxml.DomainDiskReadOnly{}
		}
		if vs.share || (disk.Shareable != nil && *disk.Shareable) {
			dd.Shareable = &libvirtxml.DomainDiskShareable{}
		}
		if disk.BootOrder != nil {
			if *disk.BootOrder == 0 {
				c.invalid(path+".bootOrder", "must be at least 1")
			}
			dd.Boot = &libvirtxml.DomainDeviceBoot{Order: *disk.BootOrder}
		}
		switch disk.Cache {
		case "", v1.CacheNone, v1.CacheWriteThrough, v1.CacheWriteBack:
			dd.Driver.Cache = string(disk.Cache)
		default:
			c.invalid(path+".cache", "unknown cache mode %q", disk.Cache)
		}
		switch disk.IO {
		case "", v1.IONative, v1.IOThreads, "default":
			dd.Driver.IO = string(disk.IO)
		default:
			c.invalid(path+".io", "unknown io mode %q", disk.IO)
		}
		if disk.ErrorPolicy != nil {
			switch p := *disk.ErrorPolicy; p {
			case v1.DiskErrorPolicyStop, v1.DiskErrorPolicyIgnore, v1.DiskErrorPolicyReport, v1.DiskErrorPolicyEnospace:
				dd.Driver.ErrorPolicy = string(p)
			default:
				c.invalid(path+".errorPolicy", "unknown policy %q", p)
			}
		}
		if bs := disk.BlockSize; bs != nil {
			if bs.MatchVolume != nil {
				c.refuse(path+".blockSize.matchVolume", "not supported")
			}
			if cs := bs.Custom; cs != nil {
				dd.BlockIO = &libvirtxml.DomainDiskBlockIO{
					LogicalBlockSize: cs.Logical, PhysicalBlockSize: cs.Physical, DiscardGranularity: cs.DiscardGranularity,
				}
			}
		}
		if disk.DedicatedIOThread != nil && *disk.DedicatedIOThread {
			c.refuse(path+".dedicatedIOThread", "not supported")
		}
		if disk.Tag != "" {
			c.refuse(path+".tag", "not supported")
		}
		if disk.ChangedBlockTracking != nil && *disk.ChangedBlockTracking {
			c.refuse(path+".changedBlockTracking", "not supported")
		}
		d.Devices.Disks = append(d.Devices.Disks, dd)
	}
	for i, v := range c.spec.Volumes {
		if !used[v.Name] {
			c.invalid(fmt.Sprintf("spec.volumes[%d]", i), "volume %q is not used by any disk", v.Name)
		}
	}
	// Every domain gets the virtio-scsi controller, as KubeVirt's do: a
	// volume hotplugged later goes onto it (a disk on a controller that
	// exists needs no free PCI slot).
	idx := uint(0)
	model := "virtio-scsi"
	if transitional {
		model = "virtio-transitional"
	}
	d.Devices.Controllers = append(d.Devices.Controllers, libvirtxml.DomainController{
		Type: "scsi", Index: &idx, Model: model,
	})
}

// containerDisk checks the fields of a containerDisk volume; the node
// supplies the pulled image in Env.Disks.
func (c *converter) containerDisk(path string, cd *v1.ContainerDiskSource) {
	if cd.Image == "" {
		c.invalid(path+".image", "empty")
	}
	switch cd.ImagePullPolicy {
	case "", k8sv1.PullAlways, k8sv1.PullIfNotPresent, k8sv1.PullNever:
	default:
		c.invalid(path+".imagePullPolicy", "unknown policy %q", cd.ImagePullPolicy)
	}
	if p := cd.Path; p != "" && (!strings.HasPrefix(p, "/") || pathpkg.Clean(p) != p || p == "/") {
		c.invalid(path+".path", "%q is not an absolute, clean path of a file in the image", p)
	}
}
