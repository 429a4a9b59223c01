package vmcontroller

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
)

// Kinds of instance types and preferences, as in matchers (lower case).
const (
	kindInstancetype        = "virtualmachineinstancetype"
	kindClusterInstancetype = "virtualmachineclusterinstancetype"
	kindPreference          = "virtualmachinepreference"
	kindClusterPreference   = "virtualmachineclusterpreference"
)

// fetched is an instance type or preference read from the API, ready to
// be frozen into a ControllerRevision.
type fetched struct {
	name       string
	uid        types.UID
	generation int64
	object     runtime.Object // with TypeMeta set
}

func (c *Controller) fetchInstancetype(ctx context.Context, ns string, m *kubevirtv1.InstancetypeMatcher) (fetched, error) {
	gv := instancetypev1beta1.SchemeGroupVersion.String()
	switch strings.ToLower(m.Kind) {
	case "", kindClusterInstancetype:
		it, err := c.cfg.Virt.ClusterInstancetypes.Get(ctx, "", m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachineclusterinstancetype %s: %w", m.Name, err)
		}
		it.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachineClusterInstancetype"}
		return fetched{it.Name, it.UID, it.Generation, it}, nil
	case kindInstancetype:
		it, err := c.cfg.Virt.Instancetypes.Get(ctx, ns, m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachineinstancetype %s: %w", m.Name, err)
		}
		it.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachineInstancetype"}
		return fetched{it.Name, it.UID, it.Generation, it}, nil
	}
	return fetched{}, fmt.Errorf("unknown instancetype kind %q", m.Kind)
}

func (c *Controller) fetchPreference(ctx context.Context, ns string, m *kubevirtv1.PreferenceMatcher) (fetched, error) {
	gv := instancetypev1beta1.SchemeGroupVersion.String()
	switch strings.ToLower(m.Kind) {
	case "", kindClusterPreference:
		p, err := c.cfg.Virt.ClusterPreferences.Get(ctx, "", m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachineclusterpreference %s: %w", m.Name, err)
		}
		p.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachineClusterPreference"}
		return fetched{p.Name, p.UID, p.Generation, p}, nil
	case kindPreference:
		p, err := c.cfg.Virt.Preferences.Get(ctx, ns, m.Name)
		if err != nil {
			return fetched{}, fmt.Errorf("virtualmachinepreference %s: %w", m.Name, err)
		}
		p.TypeMeta = metav1.TypeMeta{APIVersion: gv, Kind: "VirtualMachinePreference"}
		return fetched{p.Name, p.UID, p.Generation, p}, nil
	}
	return fetched{}, fmt.Errorf("unknown preference kind %q", m.Kind)
}

// missingRef is an instance type or preference the VM names that does not
// exist (yet); reason is KubeVirt's Failure condition reason for it.
type missingRef struct {
	reason string
	err    error
}

func (m missingRef) Error() string { return m.err.Error() }
func (m missingRef) Unwrap() error { return m.err }

// missing marks a not-found err with reason; other errors pass unchanged.
func missing(reason string, err error) error {
	if apierrors.IsNotFound(err) {
		return missingRef{reason: reason, err: err}
	}
	return err
}

// storeRevision freezes f into a ControllerRevision owned by vm, named as
// KubeVirt names it (<vm>-<object>-<uid>-<generation>), and returns its name.
func (c *Controller) storeRevision(ctx context.Context, vm *kubevirtv1.VirtualMachine, f fetched) (string, error) {
	data, err := json.Marshal(f.object)
	if err != nil {
		return "", err
	}
	name := fmt.Sprintf("%s-%s-%s-%d", vm.Name, f.name, f.uid, f.generation)
	cr := &appsv1.ControllerRevision{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: vm.Namespace,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(vm, kubevirtv1.VirtualMachineGroupVersionKind)},
			Labels:          map[string]string{"instancetype.kubevirt.io/object-kind": f.object.GetObjectKind().GroupVersionKind().Kind, "instancetype.kubevirt.io/object-name": f.name}},
		Data:     runtime.RawExtension{Raw: data},
		Revision: f.generation,
	}
	_, err = c.cfg.Kube.AppsV1().ControllerRevisions(vm.Namespace).Create(ctx, cr, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("store revision %s: %w", name, err)
	}
	return name, nil
}

// ensureRevisions stores the instance type and preference of vm and
// records their revision names in its spec, as KubeVirt does; later edits
// of the type then no longer change the VM. It reports whether the VM was
// updated (a new sync follows).
func (c *Controller) ensureRevisions(ctx context.Context, vm *kubevirtv1.VirtualMachine) (bool, error) {
	var patch []map[string]any
	if m := vm.Spec.Instancetype; m != nil && m.RevisionName == "" {
		f, err := c.fetchInstancetype(ctx, vm.Namespace, m)
		if err != nil {
			return false, missing("FailedFindInstancetype", err)
		}
		name, err := c.storeRevision(ctx, vm, f)
		if err != nil {
			return false, err
		}
		patch = append(patch, map[string]any{"op": "add", "path": "/spec/instancetype/revisionName", "value": name})
	}
	if m := vm.Spec.Preference; m != nil && m.RevisionName == "" {
		f, err := c.fetchPreference(ctx, vm.Namespace, m)
		if err != nil {
			return false, missing("FailedFindPreference", err)
		}
		name, err := c.storeRevision(ctx, vm, f)
		if err != nil {
			return false, err
		}
		patch = append(patch, map[string]any{"op": "add", "path": "/spec/preference/revisionName", "value": name})
	}
	if len(patch) == 0 {
		return false, nil
	}
	patch = append([]map[string]any{{"op": "test", "path": "/metadata/resourceVersion", "value": vm.ResourceVersion}}, patch...)
	data, _ := json.Marshal(patch)
	if _, err := c.cfg.Virt.VMs.Patch(ctx, vm.Namespace, vm.Name, types.JSONPatchType, data, metav1.PatchOptions{}); err != nil {
		return false, fmt.Errorf("record revision names: %w", err)
	}
	return true, nil
}

// revisionSpec is the part of a stored instance type or preference we use.
type revisionSpec[S any] struct {
	Kind string `json:"kind"`
	Spec S      `json:"spec"`
}

func loadRevision[S any](ctx context.Context, c *Controller, ns, name string) (*S, error) {
	cr, err := c.cfg.Kube.AppsV1().ControllerRevisions(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("controllerrevision %s: %w", name, err)
	}
	var r revisionSpec[S]
	if err := json.Unmarshal(cr.Data.Raw, &r); err != nil {
		return nil, fmt.Errorf("decode controllerrevision %s: %w", name, err)
	}
	return &r.Spec, nil
}

// expand returns the VMI spec of vm with its stored instance type and
// preference applied; conflicts are returned as field errors.
func (c *Controller) expand(ctx context.Context, vm *kubevirtv1.VirtualMachine) (*kubevirtv1.VirtualMachineInstanceSpec, map[string]string, error) {
	spec := vm.Spec.Template.Spec.DeepCopy()
	annotations := map[string]string{}
	var pref *instancetypev1beta1.VirtualMachinePreferenceSpec
	if m := vm.Spec.Preference; m != nil {
		p, err := loadRevision[instancetypev1beta1.VirtualMachinePreferenceSpec](ctx, c, vm.Namespace, m.RevisionName)
		if err != nil {
			return nil, nil, err
		}
		pref = p
	}
	if m := vm.Spec.Instancetype; m != nil {
		it, err := loadRevision[instancetypev1beta1.VirtualMachineInstancetypeSpec](ctx, c, vm.Namespace, m.RevisionName)
		if err != nil {
			return nil, nil, err
		}
		if errs := applyInstancetype(field.NewPath("spec", "template", "spec"), spec, it, pref); len(errs) > 0 {
			return nil, nil, errs.ToAggregate()
		}
		for k, v := range it.Annotations {
			annotations[k] = v
		}
		if errs := checkRequirements(spec, pref, it); len(errs) > 0 {
			return nil, nil, errs.ToAggregate()
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
	return spec, annotations, nil
}

const conflictMsg = "VM field conflicts with selected instance type"

// applyInstancetype writes it into spec; fields the template already
// sets are conflicts.
func applyInstancetype(p *field.Path, spec *kubevirtv1.VirtualMachineInstanceSpec, it *instancetypev1beta1.VirtualMachineInstancetypeSpec, pref *instancetypev1beta1.VirtualMachinePreferenceSpec) field.ErrorList {
	var errs field.ErrorList
	d := &spec.Domain
	dp := p.Child("domain")
	if d.CPU != nil && (d.CPU.Sockets != 0 || d.CPU.Cores != 0 || d.CPU.Threads != 0) {
		errs = append(errs, field.Invalid(dp.Child("cpu"), "", conflictMsg))
	}
	if _, ok := d.Resources.Requests[corev1.ResourceCPU]; ok {
		errs = append(errs, field.Invalid(dp.Child("resources", "requests", "cpu"), "", conflictMsg))
	}
	if d.Memory != nil && d.Memory.Guest != nil {
		errs = append(errs, field.Invalid(dp.Child("memory", "guest"), d.Memory.Guest.String(), conflictMsg))
	}
	if _, ok := d.Resources.Requests[corev1.ResourceMemory]; ok {
		errs = append(errs, field.Invalid(dp.Child("resources", "requests", "memory"), "", conflictMsg))
	}
	if len(it.NodeSelector) > 0 && len(spec.NodeSelector) > 0 {
		errs = append(errs, field.Invalid(p.Child("nodeSelector"), "", conflictMsg))
	}
	if it.SchedulerName != "" && spec.SchedulerName != "" {
		errs = append(errs, field.Invalid(p.Child("schedulerName"), spec.SchedulerName, conflictMsg))
	}
	if len(it.GPUs) > 0 && len(d.Devices.GPUs) > 0 {
		errs = append(errs, field.Invalid(dp.Child("devices", "gpus"), "", conflictMsg))
	}
	if len(it.HostDevices) > 0 && len(d.Devices.HostDevices) > 0 {
		errs = append(errs, field.Invalid(dp.Child("devices", "hostDevices"), "", conflictMsg))
	}
	if it.IOThreadsPolicy != nil && d.IOThreadsPolicy != nil {
		errs = append(errs, field.Invalid(dp.Child("ioThreadsPolicy"), "", conflictMsg))
	}
	if it.LaunchSecurity != nil && d.LaunchSecurity != nil {
		errs = append(errs, field.Invalid(dp.Child("launchSecurity"), "", conflictMsg))
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
