// Package expansion is the one rule that turns a VirtualMachine's template,
// its instance type and its preference into the VMI spec: the VM controller
// applies it when it starts a VM (from the stored revisions), the
// expand-spec subresource when a client asks what the VM would run.
//
// It is pure: callers find the instance type and preference (Kinds says
// which resource a matcher names) and pass their specs.
package expansion

import (
	"encoding/json"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
)

// Scope is where the object a matcher names lives.
type Scope int

const (
	// Unknown: the matcher's kind names neither resource.
	Unknown Scope = iota
	Cluster
	Namespaced
)

// InstancetypeScope is the scope of an instance type matcher's kind: empty
// or VirtualMachineClusterInstancetype is cluster-wide,
// VirtualMachineInstancetype namespaced (either case, singular or plural,
// as KubeVirt accepts them).
func InstancetypeScope(kind string) Scope {
	return scope(kind, "virtualmachineclusterinstancetype", "virtualmachineinstancetype")
}

// PreferenceScope is InstancetypeScope for preference matchers.
func PreferenceScope(kind string) Scope {
	return scope(kind, "virtualmachineclusterpreference", "virtualmachinepreference")
}

func scope(kind, cluster, namespaced string) Scope {
	switch strings.TrimSuffix(strings.ToLower(kind), "s") {
	case "", cluster:
		return Cluster
	case namespaced:
		return Namespaced
	}
	return Unknown
}

// Apply writes it (when set) and pref (when set) into spec and returns the
// annotations the VMI gets from them. Template fields the instance type
// also sets, and an instance type smaller than the preference requires,
// are field errors (path is spec's own path, e.g.
// spec.template.spec); spec is then partly written.
func Apply(path *field.Path, spec *kubevirtv1.VirtualMachineInstanceSpec, it *instancetypev1beta1.VirtualMachineInstancetypeSpec,
	pref *instancetypev1beta1.VirtualMachinePreferenceSpec) (map[string]string, field.ErrorList) {
	annotations := map[string]string{}
	if it != nil {
		if errs := applyInstancetype(path, spec, it, pref); len(errs) > 0 {
			return nil, errs
		}
		for k, v := range it.Annotations {
			annotations[k] = v
		}
		if errs := checkRequirements(spec, pref, it); len(errs) > 0 {
			return nil, errs
		}
	}
	if pref != nil {
		applyPreference(spec, pref)
		for k, v := range pref.Annotations {
			if _, ok := annotations[k]; !ok {
				annotations[k] = v
			}
		}
	}
	return annotations, nil
}

// ConflictMsg is the detail of the field error of a template field the
// instance type also sets.
const ConflictMsg = "VM field conflicts with selected instance type"

// applyInstancetype writes it into spec; fields the template already
// sets are conflicts.
func applyInstancetype(p *field.Path, spec *kubevirtv1.VirtualMachineInstanceSpec, it *instancetypev1beta1.VirtualMachineInstancetypeSpec, pref *instancetypev1beta1.VirtualMachinePreferenceSpec) field.ErrorList {
	var errs field.ErrorList
	d := &spec.Domain
	dp := p.Child("domain")
	if d.CPU != nil && (d.CPU.Sockets != 0 || d.CPU.Cores != 0 || d.CPU.Threads != 0) {
		errs = append(errs, field.Invalid(dp.Child("cpu"), "", ConflictMsg))
	}
	if _, ok := d.Resources.Requests[corev1.ResourceCPU]; ok {
		errs = append(errs, field.Invalid(dp.Child("resources", "requests", "cpu"), "", ConflictMsg))
	}
	if d.Memory != nil && d.Memory.Guest != nil {
		errs = append(errs, field.Invalid(dp.Child("memory", "guest"), d.Memory.Guest.String(), ConflictMsg))
	}
	if _, ok := d.Resources.Requests[corev1.ResourceMemory]; ok {
		errs = append(errs, field.Invalid(dp.Child("resources", "requests", "memory"), "", ConflictMsg))
	}
	if len(it.NodeSelector) > 0 && len(spec.NodeSelector) > 0 {
		errs = append(errs, field.Invalid(p.Child("nodeSelector"), "", ConflictMsg))
	}
	if it.SchedulerName != "" && spec.SchedulerName != "" {
		errs = append(errs, field.Invalid(p.Child("schedulerName"), spec.SchedulerName, ConflictMsg))
	}
	if len(it.GPUs) > 0 && len(d.Devices.GPUs) > 0 {
		errs = append(errs, field.Invalid(dp.Child("devices", "gpus"), "", ConflictMsg))
	}
	if len(it.HostDevices) > 0 && len(d.Devices.HostDevices) > 0 {
		errs = append(errs, field.Invalid(dp.Child("devices", "hostDevices"), "", ConflictMsg))
	}
	if it.IOThreadsPolicy != nil && d.IOThreadsPolicy != nil {
		errs = append(errs, field.Invalid(dp.Child("ioThreadsPolicy"), "", ConflictMsg))
	}
	if it.LaunchSecurity != nil && d.LaunchSecurity != nil {
		errs = append(errs, field.Invalid(dp.Child("launchSecurity"), "", ConflictMsg))
	}
	if len(errs) > 0 {
		return errs
	}
	if d.CPU == nil {
		d.CPU = &kubevirtv1.CPU{}
	}
	g := it.CPU.Guest
	d.CPU.Sockets, d.CPU.Cores, d.CPU.Threads = g, 1, 1
	if pref != nil && pref.CPU != nil && pref.CPU.PreferredCPUTopology != nil {
		switch *pref.CPU.PreferredCPUTopology {
		case instancetypev1beta1.Cores, instancetypev1beta1.DeprecatedPreferCores:
			d.CPU.Sockets, d.CPU.Cores = 1, g
		case instancetypev1beta1.Threads, instancetypev1beta1.DeprecatedPreferThreads:
			d.CPU.Sockets, d.CPU.Threads = 1, g
		case instancetypev1beta1.Spread, instancetypev1beta1.DeprecatedPreferSpread:
			if g%2 == 0 {
				d.CPU.Sockets, d.CPU.Cores = g/2, 2
			}
		}
	}
	if it.CPU.Model != nil {
		d.CPU.Model = *it.CPU.Model
	}
	if it.CPU.DedicatedCPUPlacement != nil {
		d.CPU.DedicatedCPUPlacement = *it.CPU.DedicatedCPUPlacement
	}
	if it.CPU.IsolateEmulatorThread != nil {
		d.CPU.IsolateEmulatorThread = *it.CPU.IsolateEmulatorThread
	}
	d.CPU.NUMA, d.CPU.Realtime = it.CPU.NUMA, it.CPU.Realtime
	if d.Memory == nil {
		d.Memory = &kubevirtv1.Memory{}
	}
	guest := it.Memory.Guest.DeepCopy()
	d.Memory.Guest = &guest
	d.Memory.Hugepages = it.Memory.Hugepages
	if len(it.NodeSelector) > 0 {
		spec.NodeSelector = it.NodeSelector
	}
	if it.SchedulerName != "" {
		spec.SchedulerName = it.SchedulerName
	}
	if len(it.GPUs) > 0 {
		d.Devices.GPUs = it.GPUs
	}
	if len(it.HostDevices) > 0 {
		d.Devices.HostDevices = it.HostDevices
	}
	if it.IOThreadsPolicy != nil {
		d.IOThreadsPolicy = it.IOThreadsPolicy
	}
	if it.LaunchSecurity != nil {
		d.LaunchSecurity = it.LaunchSecurity
	}
	return nil
}

// checkRequirements refuses an instance type smaller than the
// preference requires.
func checkRequirements(spec *kubevirtv1.VirtualMachineInstanceSpec, pref *instancetypev1beta1.VirtualMachinePreferenceSpec, it *instancetypev1beta1.VirtualMachineInstancetypeSpec) field.ErrorList {
	if pref == nil || pref.Requirements == nil {
		return nil
	}
	var errs field.ErrorList
	if r := pref.Requirements.CPU; r != nil && it.CPU.Guest < r.Guest {
		errs = append(errs, field.Invalid(field.NewPath("spec", "instancetype"), it.CPU.Guest,
			fmt.Sprintf("insufficient CPU resources of %d vCPU provided by instance type, preference requires %d vCPU", it.CPU.Guest, r.Guest)))
	}
	if r := pref.Requirements.Memory; r != nil && it.Memory.Guest.Cmp(r.Guest) < 0 {
		errs = append(errs, field.Invalid(field.NewPath("spec", "instancetype"), it.Memory.Guest.String(),
			fmt.Sprintf("insufficient Memory resources of %s provided by instance type, preference requires %s", it.Memory.Guest.String(), r.Guest.String())))
	}
	return errs
}

// applyPreference fills what the template leaves unset.
func applyPreference(spec *kubevirtv1.VirtualMachineInstanceSpec, pref *instancetypev1beta1.VirtualMachinePreferenceSpec) {
	d := &spec.Domain
	if dp := pref.Devices; dp != nil {
		for i := range d.Devices.Disks {
			if t := d.Devices.Disks[i].Disk; t != nil && t.Bus == "" && dp.PreferredDiskBus != "" {
				t.Bus = dp.PreferredDiskBus
			} else if d.Devices.Disks[i].Disk == nil && d.Devices.Disks[i].CDRom == nil && d.Devices.Disks[i].LUN == nil && dp.PreferredDiskBus != "" {
				d.Devices.Disks[i].Disk = &kubevirtv1.DiskTarget{Bus: dp.PreferredDiskBus}
			}
		}
		for i := range d.Devices.Interfaces {
			if d.Devices.Interfaces[i].Model == "" && dp.PreferredInterfaceModel != "" {
				d.Devices.Interfaces[i].Model = dp.PreferredInterfaceModel
			}
		}
		set := func(dst **bool, src *bool) {
			if *dst == nil && src != nil {
				v := *src
				*dst = &v
			}
		}
		set(&d.Devices.AutoattachPodInterface, dp.PreferredAutoattachPodInterface)
		set(&d.Devices.AutoattachGraphicsDevice, dp.PreferredAutoattachGraphicsDevice)
		set(&d.Devices.AutoattachMemBalloon, dp.PreferredAutoattachMemBalloon)
		set(&d.Devices.AutoattachSerialConsole, dp.PreferredAutoattachSerialConsole)
		set(&d.Devices.AutoattachInputDevice, dp.PreferredAutoattachInputDevice)
	}
	if mp := pref.Machine; mp != nil && mp.PreferredMachineType != "" && (d.Machine == nil || d.Machine.Type == "") {
		d.Machine = &kubevirtv1.Machine{Type: mp.PreferredMachineType}
	}
	if fp := pref.Firmware; fp != nil && d.Firmware == nil {
		if fp.DeprecatedPreferredUseEfi != nil && *fp.DeprecatedPreferredUseEfi {
			d.Firmware = &kubevirtv1.Firmware{Bootloader: &kubevirtv1.Bootloader{EFI: &kubevirtv1.EFI{SecureBoot: fp.DeprecatedPreferredUseSecureBoot}}}
		} else if fp.PreferredUseBios != nil && *fp.PreferredUseBios {
			d.Firmware = &kubevirtv1.Firmware{Bootloader: &kubevirtv1.Bootloader{BIOS: &kubevirtv1.BIOS{UseSerial: fp.PreferredUseBiosSerial}}}
		}
	}
	if g := pref.PreferredTerminationGracePeriodSeconds; g != nil && spec.TerminationGracePeriodSeconds == nil {
		v := *g
		spec.TerminationGracePeriodSeconds = &v
	}
	if s := pref.PreferredSubdomain; s != nil && spec.Subdomain == "" {
		spec.Subdomain = *s
	}
}

// revision is the part of a stored instance type or preference (a
// ControllerRevision's data) expansion reads.
type revision[S any] struct {
	Spec S `json:"spec"`
}

// RevisionSpec decodes the spec of an instance type or preference frozen
// in a ControllerRevision's data.
func RevisionSpec[S any](data []byte) (*S, error) {
	var r revision[S]
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	return &r.Spec, nil
}
