package handler

import (
	"errors"
	"fmt"

	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/nodeagent/hostdisk"
)

// resolveHostDisks adds the file of every hostDisk volume of vmi to disks:
// only with the KubeVirt CR's HostDisk feature gate on (admission refuses
// such VMIs too; this holds for VMIs made before the gate was turned off),
// and only inside the node's host disk root (package hostdisk). A refusal
// fails the VMI with the reason on its Synchronized condition.
func (h *Handler) resolveHostDisks(vmi *v1.VirtualMachineInstance, disks map[string]domain.DiskSource) error {
	for i, vol := range vmi.Spec.Volumes {
		hd := vol.HostDisk
		if hd == nil {
			continue
		}
		if !h.gateEnabled(featuregate.HostDisk) {
			return fmt.Errorf("%w: spec.volumes[%d] (%s): HostDisk feature gate is not enabled", errSpec, i, vol.Name)
		}
		path, created, err := h.hostDisks.Resolve(hd)
		if errors.Is(err, hostdisk.ErrRefused) {
			return fmt.Errorf("%w: spec.volumes[%d] (%s): %w", errSpec, i, vol.Name, err)
		}
		if err != nil {
			return fmt.Errorf("spec.volumes[%d] (%s): %w", i, vol.Name, err)
		}
		if created {
			h.log.Info("created hostDisk", "vmi", vmi.Namespace+"/"+vmi.Name, "path", path, "capacity", hd.Capacity.String())
		}
		disks[vol.Name] = domain.DiskSource{Path: path, Format: domain.FormatRaw}
	}
	return nil
}

// gateEnabled reports whether a KubeVirt CR turns gate on.
func (h *Handler) gateEnabled(gate string) bool {
	for _, o := range h.kubevirt.GetStore().List() {
		if kv, ok := o.(*v1.KubeVirt); ok && featuregate.KubeVirtEnabled(kv, gate) {
			return true
		}
	}
	return false
}
