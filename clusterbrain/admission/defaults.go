package admission

import (
	"context"
	"encoding/json"
	"strings"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// mutateVMI applies the defaults KubeVirt applies when a VMI is created,
// the KubeVirt CR's default CPU model, memory overcommit and (under the
// LiveUpdate rollout strategy) the maxSockets of CPU hotplug among them.
func (k *kubevirtWebhooks) mutateVMI(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vmi kubevirtv1.VirtualMachineInstance
	if err := json.Unmarshal(req.Object.Raw, &vmi); err != nil {
		return Denyf("decode virtualmachineinstance: %v", err)
	}
	// The overcommitted request first: defaultVMISpec makes the request
	// the guest's size.
	changed := k.cfg.memoryOvercommit(ctx).Apply(&vmi.Spec)
	if defaultVMISpec(&vmi.Spec) {
		changed = true
	}
	if k.cfg.cpuModels(ctx).Apply(&vmi.Spec) {
		changed = true
	}
	if k.cfg.rollout(ctx).SetupCPUHotplug(&vmi.Spec) {
		changed = true
	}
	if !changed {
		return Allow() // already defaulted (as the VM controller creates VMIs)
	}
	return Patch([]PatchOp{{Op: "replace", Path: "/spec", Value: vmi.Spec}})
}

// DefaultVMISpec fills what KubeVirt defaults: the pod network with a
// masquerade interface when no network is given, a disk for every volume
// no disk or filesystem names (instance type examples give none), a virtio
// disk target, the
// q35 machine, a 1×1×1 CPU topology and memory request and guest memory
// from each other.
func DefaultVMISpec(s *kubevirtv1.VirtualMachineInstanceSpec) { defaultVMISpec(s) }

// defaultVMISpec applies the defaults and reports whether it changed s.
func defaultVMISpec(s *kubevirtv1.VirtualMachineInstanceSpec) bool {
	changed := false
	d := &s.Domain
	auto := d.Devices.AutoattachPodInterface
	if len(d.Devices.Interfaces) == 0 && len(s.Networks) == 0 && (auto == nil || *auto) {
		s.Networks = []kubevirtv1.Network{*kubevirtv1.DefaultPodNetwork()}
		d.Devices.Interfaces = []kubevirtv1.Interface{{Name: "default",
			InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Masquerade: &kubevirtv1.InterfaceMasquerade{}}}}
		changed = true
	}
	named := map[string]bool{}
	for _, dk := range d.Devices.Disks {
		named[dk.Name] = true
	}
	for _, fs := range d.Devices.Filesystems {
		named[fs.Name] = true
	}
	for i, v := range s.Volumes {
		if !named[v.Name] {
			d.Devices.Disks = append(d.Devices.Disks, kubevirtv1.Disk{Name: v.Name})
			changed = true
		}
		if cd := s.Volumes[i].ContainerDisk; cd != nil && cd.ImagePullPolicy == "" {
			cd.ImagePullPolicy = defaultPullPolicy(cd.Image)
			changed = true
		}
	}
	for i := range d.Devices.Disks {
		dk := &d.Devices.Disks[i]
		if dk.Disk == nil && dk.LUN == nil && dk.CDRom == nil {
			dk.Disk = &kubevirtv1.DiskTarget{}
			changed = true
		}
		if dk.Disk != nil && dk.Disk.Bus == "" {
			dk.Disk.Bus = kubevirtv1.DiskBusVirtio
			changed = true
		}
	}
	if d.Machine == nil {
		d.Machine = &kubevirtv1.Machine{Type: "q35"}
		changed = true
	}
	if d.CPU == nil {
		d.CPU = &kubevirtv1.CPU{}
		changed = true
	}
	for _, n := range []*uint32{&d.CPU.Sockets, &d.CPU.Cores, &d.CPU.Threads} {
		if *n == 0 {
			*n = 1
			changed = true
		}
	}
	req, hasReq := d.Resources.Requests[corev1.ResourceMemory]
	if d.Memory == nil || d.Memory.Guest == nil {
		g := req
		if !hasReq {
			g, hasReq = d.Resources.Limits[corev1.ResourceMemory]
		}
		if hasReq {
			if d.Memory == nil {
				d.Memory = &kubevirtv1.Memory{}
			}
			d.Memory.Guest = &g
			changed = true
		}
	}
	// A guest size with no memory request (given, or just taken from the
	// limit) becomes the request, so one pass settles the defaults.
	if _, hasReq := d.Resources.Requests[corev1.ResourceMemory]; !hasReq && d.Memory != nil && d.Memory.Guest != nil {
		if d.Resources.Requests == nil {
			d.Resources.Requests = corev1.ResourceList{}
		}
		d.Resources.Requests[corev1.ResourceMemory] = d.Memory.Guest.DeepCopy()
		changed = true
	}
	return changed
}

// defaultPullPolicy is a containerDisk's pull policy when the spec names
// none, as container runtimes and KubeVirt choose it: Always for an image
// without a tag or tagged latest, IfNotPresent for one pinned by a digest
// or another tag. The node agent applies the same rule to VMIs admitted
// without this webhook.
func defaultPullPolicy(image string) corev1.PullPolicy {
	name, _, pinned := strings.Cut(image, "@")
	if pinned {
		return corev1.PullIfNotPresent
	}
	tag := ""
	if i := strings.LastIndex(name, ":"); i > strings.LastIndex(name, "/") {
		tag = name[i+1:]
	}
	if tag == "" || tag == "latest" {
		return corev1.PullAlways
	}
	return corev1.PullIfNotPresent
}
