package domain

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"
)

// DefaultMachineType is the machine type of a VMI that names none.
const DefaultMachineType = "q35"

// FieldError says that a VMI field cannot be honoured. Path names the field
// the way kubectl explain does (spec.domain.devices.gpus).
type FieldError struct {
	Path   string
	Reason string
	// Unsupported tells a field nodevirt does not implement from an
	// invalid one; such errors wrap ErrNotSupported.
	Unsupported bool
}

func (e *FieldError) Error() string { return e.Path + ": " + e.Reason }

// Unwrap returns ErrNotSupported for an unsupported field.
func (e *FieldError) Unwrap() error {
	if e.Unsupported {
		return ErrNotSupported
	}
	return nil
}

// ErrNotSupported is wrapped by every FieldError made for a field nodevirt
// does not implement, so callers can tell "not yet" from "invalid".
var ErrNotSupported = errors.New("not supported")

// Convert builds the libvirt domain of vmi on a node described by env.
//
// Convert is pure: it creates no files (Prepare does). Every field it cannot
// honour is reported, all at once, as a joined list of *FieldError; nothing is
// silently dropped. spec.startStrategy is not part of a domain definition:
// the caller starts the domain paused when StartPaused(vmi) says so.
func Convert(vmi *v1.VirtualMachineInstance, env Env) (*libvirtxml.Domain, error) {
	if vmi == nil {
		return nil, errors.New("convert: nil vmi")
	}
	if vmi.Name == "" || vmi.Namespace == "" {
		return nil, errors.New("convert: vmi has no namespace or name")
	}
	if err := env.validate(); err != nil {
		return nil, fmt.Errorf("convert %s/%s: %w", vmi.Namespace, vmi.Name, err)
	}
	c := &converter{vmi: vmi, spec: &vmi.Spec, env: env.defaulted()}
	d := c.convert()
	if len(c.errs) > 0 {
		return nil, fmt.Errorf("convert %s/%s: %w", vmi.Namespace, vmi.Name, errors.Join(c.errs...))
	}
	return d, nil
}

// StartPaused reports whether the VMI asks to start with its CPUs paused.
func StartPaused(vmi *v1.VirtualMachineInstance) bool {
	return vmi.Spec.StartStrategy != nil && *vmi.Spec.StartStrategy == v1.StartStrategyPaused
}

type converter struct {
	vmi   *v1.VirtualMachineInstance
	spec  *v1.VirtualMachineInstanceSpec
	env   Env
	errs  []error
	vcpus uint
}

func (c *converter) refuse(path, format string, args ...any) {
	c.errs = append(c.errs, &FieldError{Path: path, Reason: fmt.Sprintf(format, args...), Unsupported: true})
}

func (c *converter) invalid(path, format string, args ...any) {
	c.errs = append(c.errs, &FieldError{Path: path, Reason: fmt.Sprintf(format, args...)})
}

func (c *converter) fail(err error) { c.errs = append(c.errs, err) }

func (c *converter) convert() *libvirtxml.Domain {
	typ := "kvm"
	if c.env.Emulation {
		typ = "qemu"
	}
	d := &libvirtxml.Domain{
		Type:    typ,
		Name:    Name(c.vmi.Namespace, c.vmi.Name),
		Devices: &libvirtxml.DomainDeviceList{Emulator: c.env.Emulator},
	}
	c.refuseSpec()
	c.cpu(d)
	hardLimit := c.memory(d)
	md, err := Metadata{
		UID: string(c.vmi.UID), Namespace: c.vmi.Namespace, Name: c.vmi.Name, MemoryHardLimitKiB: hardLimit,
	}.Marshal()
	if err != nil {
		c.fail(err)
	}
	d.Metadata = &libvirtxml.DomainMetadata{XML: md}
	c.os(d)
	c.features(d)
	c.clock(d)
	c.lifecycle(d)
	c.disks(d)
	c.interfaces(d)
	c.devices(d)
	return d
}

// refuseSpec refuses the VMI-level fields the launcher cannot honour.
// Scheduling fields (nodeSelector, affinity, tolerations, priority, eviction)
// are the brain's business and pass.
func (c *converter) refuseSpec() {
	s := c.spec
	switch s.Architecture {
	case "", "amd64", "x86_64":
	default:
		c.refuse("spec.architecture", "%q is not supported (only amd64)", s.Architecture)
	}
	if len(s.AccessCredentials) > 0 {
		c.refuse("spec.accessCredentials", "not supported")
	}
	if len(s.ResourceClaims) > 0 {
		c.refuse("spec.resourceClaims", "not supported")
	}
	if len(s.UtilityVolumes) > 0 {
		c.refuse("spec.utilityVolumes", "not supported")
	}
	if s.LivenessProbe != nil {
		c.refuse("spec.livenessProbe", "not supported")
	}
	if s.ReadinessProbe != nil {
		c.refuse("spec.readinessProbe", "not supported")
	}
	dom := &s.Domain
	if dom.IOThreadsPolicy != nil {
		c.refuse("spec.domain.ioThreadsPolicy", "not supported")
	}
	if dom.IOThreads != nil {
		c.refuse("spec.domain.ioThreads", "not supported")
	}
	if dom.LaunchSecurity != nil {
		c.refuse("spec.domain.launchSecurity", "not supported")
	}
}

// resourceQuantity returns resources.limits[name] or, when unset, requests[name].
func (c *converter) resourceQuantity(name k8sv1.ResourceName) (resource.Quantity, bool) {
	r := c.spec.Domain.Resources
	if q, ok := r.Limits[name]; ok {
		return q, true
	}
	q, ok := r.Requests[name]
	return q, ok
}

func (c *converter) cpu(d *libvirtxml.Domain) {
	const path = "spec.domain.cpu"
	cpu := c.spec.Domain.CPU
	if cpu == nil {
		cpu = &v1.CPU{}
	}
	sockets, cores, threads := uint(cpu.Sockets), uint(cpu.Cores), uint(cpu.Threads)
	if sockets == 0 && cores == 0 && threads == 0 {
		// No topology: as many single-core sockets as the CPU resources ask
		// (rounded up), as KubeVirt does.
		sockets = 1
		if q, ok := c.resourceQuantity(k8sv1.ResourceCPU); ok {
			sockets = uint(max(1, (q.MilliValue()+999)/1000))
		}
	}
	sockets, cores, threads = max(sockets, 1), max(cores, 1), max(threads, 1)
	c.vcpus = sockets * cores * threads

	maxSockets := uint(cpu.MaxSockets)
	switch {
	case maxSockets == 0 || maxSockets == sockets:
		d.VCPU = &libvirtxml.DomainVCPU{Placement: "static", Value: c.vcpus}
		maxSockets = sockets
	case maxSockets < sockets:
		c.invalid(path+".maxSockets", "%d is less than sockets %d", maxSockets, sockets)
	default:
		d.VCPU = &libvirtxml.DomainVCPU{Placement: "static", Value: maxSockets * cores * threads, Current: c.vcpus}
	}
	dc := &libvirtxml.DomainCPU{Topology: &libvirtxml.DomainCPUTopology{
		Sockets: int(maxSockets), Dies: 1, Cores: int(cores), Threads: int(threads),
	}}
	switch cpu.Model {
	case "", v1.CPUModeHostModel, v1.CPUModeHostPassthrough:
		switch {
		case c.env.Emulation:
			// TCG cannot pass the host CPU through; "maximum" gives the guest
			// every feature QEMU can emulate.
			dc.Mode = "maximum"
		case cpu.Model == v1.CPUModeHostPassthrough:
			dc.Mode = "host-passthrough"
		default:
			dc.Mode = "host-model"
		}
	default:
		dc.Mode = "custom"
		dc.Match = "exact"
		dc.Model = &libvirtxml.DomainCPUModel{Value: cpu.Model, Fallback: "forbid"}
	}
	for i, f := range cpu.Features {
		policy := f.Policy
		switch policy {
		case "":
			policy = "require"
		case "force", "require", "optional", "disable", "forbid":
		default:
			c.invalid(fmt.Sprintf("%s.features[%d].policy", path, i), "unknown policy %q", policy)
		}
		if f.Name == "" {
			c.invalid(fmt.Sprintf("%s.features[%d].name", path, i), "empty feature name")
		}
		dc.Features = append(dc.Features, libvirtxml.DomainCPUFeature{Name: f.Name, Policy: policy})
	}
	if cpu.DedicatedCPUPlacement {
		c.refuse(path+".dedicatedCpuPlacement", "not supported yet")
	}
	if cpu.IsolateEmulatorThread {
		c.refuse(path+".isolateEmulatorThread", "not supported yet")
	}
	if cpu.Realtime != nil {
		c.refuse(path+".realtime", "not supported")
	}
	if cpu.NUMA != nil {
		c.refuse(path+".numa", "not supported")
	}
	d.CPU = dc

	// CPU cgroup of the domain: requests weigh it against other VMs, limits
	// cap the whole domain (vCPUs and emulator threads together).
	res := c.spec.Domain.Resources
	tune := &libvirtxml.DomainCPUTune{}
	if q, ok := res.Requests[k8sv1.ResourceCPU]; ok {
		tune.Shares = &libvirtxml.DomainCPUTuneShares{Value: uint(max(2, q.MilliValue()*1024/1000))}
	}
	if q, ok := res.Limits[k8sv1.ResourceCPU]; ok {
		const period = 100000
		tune.GlobalPeriod = &libvirtxml.DomainCPUTunePeriod{Value: period}
		tune.GlobalQuota = &libvirtxml.DomainCPUTuneQuota{Value: max(1000, q.MilliValue()*period/1000)}
	}
	if tune.Shares != nil || tune.GlobalQuota != nil {
		d.CPUTune = tune
	}
}

func kib(bytes int64) uint { return uint((bytes + 1023) / 1024) }

// memory sets the guest memory and its backing, and returns the memory hard
// limit of the domain's cgroup in KiB (0 for none), see
// Metadata.MemoryHardLimitKiB.
func (c *converter) memory(d *libvirtxml.Domain) uint64 {
	const path = "spec.domain.memory"
	mem := c.spec.Domain.Memory
	if mem == nil {
		mem = &v1.Memory{}
	}
	res := c.spec.Domain.Resources
	var guest *resource.Quantity
	switch {
	case mem.Guest != nil:
		guest = mem.Guest
	default:
		if q, ok := res.Requests[k8sv1.ResourceMemory]; ok {
			guest = &q
		} else if q, ok := res.Limits[k8sv1.ResourceMemory]; ok {
			guest = &q
		}
	}
	if guest == nil || guest.Value() <= 0 {
		c.invalid(path+".guest", "guest memory is not set (set memory.guest or resources.requests.memory)")
		return 0
	}
	d.Memory = &libvirtxml.DomainMemory{Value: kib(guest.Value()), Unit: "KiB"}
	if mem.MaxGuest != nil && mem.MaxGuest.Cmp(*guest) != 0 {
		c.refuse(path+".maxGuest", "memory hotplug is not supported")
	}

	backing := &libvirtxml.DomainMemoryBacking{}
	if mem.Hugepages != nil {
		size, err := resource.ParseQuantity(mem.Hugepages.PageSize)
		if err != nil || size.Value() <= 0 {
			c.invalid(path+".hugepages.pageSize", "%q is not a page size", mem.Hugepages.PageSize)
		} else {
			if guest.Value()%size.Value() != 0 {
				c.invalid(path+".guest", "%s is not a multiple of the hugepage size %s", guest, mem.Hugepages.PageSize)
			}
			backing.MemoryHugePages = &libvirtxml.DomainMemoryHugepages{
				Hugepages: []libvirtxml.DomainMemoryHugepage{{Size: kib(size.Value()), Unit: "KiB"}},
			}
		}
	}
	var added int64
	if ro := mem.ReservedOverhead; ro != nil {
		if ro.AddedOverhead != nil {
			added = ro.AddedOverhead.Value()
		}
		if ro.MemLock != nil && *ro.MemLock == v1.MemLockRequired {
			backing.MemoryLocked = &libvirtxml.DomainMemoryLocked{}
		}
	}
	if backing.MemoryHugePages != nil || backing.MemoryLocked != nil {
		d.MemoryBacking = backing
	}

	if lim, ok := res.Limits[k8sv1.ResourceMemory]; ok {
		if guest.Cmp(lim) > 0 {
			c.invalid(path+".guest", "%s exceeds resources.limits.memory %s", guest, &lim)
		}
		hard := lim.Value() + c.env.MemoryOverhead + added
		if hard < 0 || hard > math.MaxInt64/2 {
			c.invalid("spec.domain.resources.limits.memory", "%s is out of range", &lim)
			return 0
		}
		return uint64(kib(hard))
	}
	return 0
}

func (c *converter) os(d *libvirtxml.Domain) {
	const path = "spec.domain.firmware"
	machine := DefaultMachineType
	if m := c.spec.Domain.Machine; m != nil && m.Type != "" {
		machine = m.Type
	}
	d.OS = &libvirtxml.DomainOS{
		Type:   &libvirtxml.DomainOSType{Arch: "x86_64", Machine: machine, Type: "hvm"},
		SMBios: &libvirtxml.DomainSMBios{Mode: "sysinfo"},
	}
	fw := c.spec.Domain.Firmware
	if fw == nil {
		fw = &v1.Firmware{}
	}
	d.UUID = string(fw.UUID)
	if d.UUID == "" {
		d.UUID = string(c.vmi.UID)
	}
	system := []libvirtxml.DomainSysInfoEntry{
		{Name: "manufacturer", Value: "KubeVirt"},
		{Name: "product", Value: "None"},
		{Name: "family", Value: "KubeVirt"},
	}
	if d.UUID != "" {
		system = append(system, libvirtxml.DomainSysInfoEntry{Name: "uuid", Value: d.UUID})
	}
	if fw.Serial != "" {
		system = append(system, libvirtxml.DomainSysInfoEntry{Name: "serial", Value: fw.Serial})
	}
	smbios := &libvirtxml.DomainSysInfoSMBIOS{System: &libvirtxml.DomainSysInfoSystem{Entry: system}}
	if ch := c.spec.Domain.Chassis; ch != nil {
		var entries []libvirtxml.DomainSysInfoEntry
		for _, e := range []struct{ name, value string }{
			{"manufacturer", ch.Manufacturer}, {"version", ch.Version}, {"serial", ch.Serial},
			{"asset", ch.Asset}, {"sku", ch.Sku},
		} {
			if e.value != "" {
				entries = append(entries, libvirtxml.DomainSysInfoEntry{Name: e.name, Value: e.value})
			}
		}
		smbios.Chassis = &libvirtxml.DomainSysInfoChassis{Entry: entries}
	}
	d.SysInfo = []libvirtxml.DomainSysInfo{{SMBIOS: smbios}}

	if fw.KernelBoot != nil {
		c.refuse(path+".kernelBoot", "not supported (kernel boot needs container images)")
	}
	if fw.ACPI != nil {
		c.refuse(path+".acpi", "not supported")
	}
	bl := fw.Bootloader
	if bl == nil {
		return
	}
	if bl.BIOS != nil && bl.EFI != nil {
		c.invalid(path+".bootloader", "bios and efi are mutually exclusive")
		return
	}
	if bl.BIOS != nil && bl.BIOS.UseSerial != nil && *bl.BIOS.UseSerial {
		d.OS.BIOS = &libvirtxml.DomainBIOS{UseSerial: "yes"}
	}
	if efi := bl.EFI; efi != nil {
		if efi.Persistent != nil && *efi.Persistent {
			c.refuse(path+".bootloader.efi.persistent", "not supported yet")
		}
		code, vars, secure := "OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd", "no"
		if efiSecureBoot(efi) {
			code, vars, secure = "OVMF_CODE_4M.secboot.fd", "OVMF_VARS_4M.ms.fd", "yes"
		}
		d.OS.Loader = &libvirtxml.DomainLoader{
			Path: filepath.Join(c.env.OVMFDir, code), Readonly: "yes", Secure: secure, Type: "pflash",
		}
		d.OS.NVRam = &libvirtxml.DomainNVRam{
			NVRam: c.env.NVRAMPath(), Template: filepath.Join(c.env.OVMFDir, vars),
		}
	}
}

// efiSecureBoot applies KubeVirt's default: secure boot unless turned off.
func efiSecureBoot(efi *v1.EFI) bool { return efi.SecureBoot == nil || *efi.SecureBoot }

func onOff(enabled *bool) string {
	if enabled == nil || *enabled {
		return "on"
	}
	return "off"
}

func (c *converter) features(d *libvirtxml.Domain) {
	const path = "spec.domain.features"
	f := c.spec.Domain.Features
	if f == nil {
		f = &v1.Features{}
	}
	fl := &libvirtxml.DomainFeatureList{}
	// ACPI is on unless turned off: graceful shutdown and soft reboot need it.
	if f.ACPI.Enabled == nil || *f.ACPI.Enabled {
		fl.ACPI = &libvirtxml.DomainFeature{}
	}
	if f.APIC == nil || f.APIC.Enabled == nil || *f.APIC.Enabled {
		fl.APIC = &libvirtxml.DomainFeatureAPIC{}
		if f.APIC != nil && f.APIC.EndOfInterrupt {
			fl.APIC.EOI = "on"
		}
	}
	secureBoot := false
	if fw := c.spec.Domain.Firmware; fw != nil && fw.Bootloader != nil && fw.Bootloader.EFI != nil {
		secureBoot = efiSecureBoot(fw.Bootloader.EFI)
	}
	switch {
	case f.SMM != nil:
		fl.SMM = &libvirtxml.DomainFeatureSMM{State: onOff(f.SMM.Enabled)}
		if secureBoot && fl.SMM.State == "off" {
			c.invalid(path+".smm", "EFI secure boot needs SMM")
		}
	case secureBoot:
		fl.SMM = &libvirtxml.DomainFeatureSMM{State: "on"}
	}
	if f.Pvspinlock != nil {
		fl.PVSpinlock = &libvirtxml.DomainFeatureState{State: onOff(f.Pvspinlock.Enabled)}
	}
	if f.KVM != nil && f.KVM.Hidden {
		fl.KVM = &libvirtxml.DomainFeatureKVM{Hidden: &libvirtxml.DomainFeatureState{State: "on"}}
	}
	if f.HypervPassthrough != nil && f.HypervPassthrough.Enabled != nil && *f.HypervPassthrough.Enabled {
		if f.Hyperv != nil {
			c.invalid(path+".hypervPassthrough", "cannot be combined with features.hyperv")
		}
		fl.HyperV = &libvirtxml.DomainFeatureHyperV{Mode: "passthrough"}
	}
	if h := f.Hyperv; h != nil {
		fl.HyperV = hyperv(h)
		if h.VendorID != nil && len(h.VendorID.VendorID) > 12 {
			c.invalid(path+".hyperv.vendorid.vendorid", "%q is longer than 12 characters", h.VendorID.VendorID)
		}
	}
	d.Features = fl
}

func hypervState(s *v1.FeatureState) *libvirtxml.DomainFeatureState {
	if s == nil {
		return nil
	}
	return &libvirtxml.DomainFeatureState{State: onOff(s.Enabled)}
}

func hyperv(h *v1.FeatureHyperv) *libvirtxml.DomainFeatureHyperV {
	out := &libvirtxml.DomainFeatureHyperV{
		Mode:            "custom",
		Relaxed:         hypervState(h.Relaxed),
		VAPIC:           hypervState(h.VAPIC),
		VPIndex:         hypervState(h.VPIndex),
		Runtime:         hypervState(h.Runtime),
		Synic:           hypervState(h.SyNIC),
		Reset:           hypervState(h.Reset),
		Frequencies:     hypervState(h.Frequencies),
		ReEnlightenment: hypervState(h.Reenlightenment),
		IPI:             hypervState(h.IPI),
		EVMCS:           hypervState(h.EVMCS),
	}
	if s := h.Spinlocks; s != nil {
		out.Spinlocks = &libvirtxml.DomainFeatureHyperVSpinlocks{DomainFeatureState: *hypervState(&s.FeatureState)}
		if s.Retries != nil {
			out.Spinlocks.Retries = uint(*s.Retries)
		}
	}
	if s := h.SyNICTimer; s != nil {
		out.STimer = &libvirtxml.DomainFeatureHyperVSTimer{
			DomainFeatureState: *hypervState(&s.FeatureState), Direct: hypervState(s.Direct),
		}
	}
	if s := h.VendorID; s != nil {
		out.VendorId = &libvirtxml.DomainFeatureHyperVVendorId{
			DomainFeatureState: *hypervState(&s.FeatureState), Value: s.VendorID,
		}
	}
	if s := h.TLBFlush; s != nil {
		out.TLBFlush = &libvirtxml.DomainFeatureHyperVTLBFlush{
			DomainFeatureState: *hypervState(&s.FeatureState),
			Direct:             hypervState(s.Direct),
			Extended:           hypervState(s.Extended),
		}
	}
	return out
}

func (c *converter) clock(d *libvirtxml.Domain) {
	const path = "spec.domain.clock"
	cl := c.spec.Domain.Clock
	d.Clock = &libvirtxml.DomainClock{Offset: "utc"}
	if cl == nil {
		return
	}
	switch {
	case cl.UTC != nil && cl.Timezone != nil:
		c.invalid(path, "utc and timezone are mutually exclusive")
	case cl.Timezone != nil:
		d.Clock = &libvirtxml.DomainClock{Offset: "timezone", TimeZone: string(*cl.Timezone)}
	case cl.UTC != nil && cl.UTC.OffsetSeconds != nil:
		d.Clock = &libvirtxml.DomainClock{
			Offset: "variable", Basis: "utc", Adjustment: fmt.Sprint(*cl.UTC.OffsetSeconds),
		}
	}
	t := cl.Timer
	if t == nil {
		return
	}
	present := func(e *bool) string {
		if e == nil || *e {
			return "yes"
		}
		return "no"
	}
	if t.HPET != nil {
		d.Clock.Timer = append(d.Clock.Timer, libvirtxml.DomainTimer{
			Name: "hpet", TickPolicy: string(t.HPET.TickPolicy), Present: present(t.HPET.Enabled)})
	}
	if t.KVM != nil {
		d.Clock.Timer = append(d.Clock.Timer, libvirtxml.DomainTimer{Name: "kvmclock", Present: present(t.KVM.Enabled)})
	}
	if t.PIT != nil {
		d.Clock.Timer = append(d.Clock.Timer, libvirtxml.DomainTimer{
			Name: "pit", TickPolicy: string(t.PIT.TickPolicy), Present: present(t.PIT.Enabled)})
	}
	if t.RTC != nil {
		d.Clock.Timer = append(d.Clock.Timer, libvirtxml.DomainTimer{
			Name: "rtc", TickPolicy: string(t.RTC.TickPolicy), Track: string(t.RTC.Track), Present: present(t.RTC.Enabled)})
	}
	if t.Hyperv != nil {
		d.Clock.Timer = append(d.Clock.Timer, libvirtxml.DomainTimer{Name: "hypervclock", Present: present(t.Hyperv.Enabled)})
	}
}

func (c *converter) lifecycle(d *libvirtxml.Domain) {
	// A guest that powers off ends the domain (the VMI becomes Succeeded);
	// a crash ends it too (Failed).
	d.OnPoweroff = "destroy"
	d.OnCrash = "destroy"
	d.OnReboot = "restart"
	if rp := c.spec.Domain.RebootPolicy; rp != nil {
		switch *rp {
		case v1.RebootPolicyReboot:
		case v1.RebootPolicyTerminate:
			d.OnReboot = "destroy"
		default:
			c.invalid("spec.domain.rebootPolicy", "unknown policy %q", *rp)
		}
	}
}
