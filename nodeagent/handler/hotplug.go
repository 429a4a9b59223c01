package handler

import (
	"context"
	"errors"
	"fmt"
	"strings"

	k8sv1 "k8s.io/api/core/v1"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// Reasons and messages of status.volumeStatus, as virt-handler words them.
const (
	reasonVolumeReady    = "VolumeReady"
	reasonVolumePending  = "PVCNotReady"
	reasonAttachFailed   = "FailedAttach"
	reasonVolumeDetached = "VolumeDetaching"
)

// errHotplugPending marks a hotplugged volume that could not be attached
// yet: the VMI is queued again with back-off.
var errHotplugPending = errors.New("hotplugged volume not attached yet")

// claimOf is the claim a PVC or DataVolume volume names ("" for others).
func claimOf(vol *v1.Volume) string {
	switch s := vol.VolumeSource; {
	case s.PersistentVolumeClaim != nil:
		return s.PersistentVolumeClaim.ClaimName
	case s.DataVolume != nil:
		return s.DataVolume.Name
	}
	return ""
}

// hasHotplug reports whether vmi has a hotplugged volume in its spec, or
// one still being detached in its status.
func hasHotplug(vmi *v1.VirtualMachineInstance) bool {
	for i := range vmi.Spec.Volumes {
		if domain.Hotpluggable(&vmi.Spec.Volumes[i]) {
			return true
		}
	}
	for _, st := range vmi.Status.VolumeStatus {
		if st.HotplugVolume != nil {
			return true
		}
	}
	return false
}

// syncHotplug brings the running domain's disks in line with the VMI's
// hotplugged volumes, the way virt-handler and virt-launcher do together:
// a hotpluggable volume the domain lacks is resolved on this node and
// attached live; a disk the domain has that the spec no longer names (a
// hotplugged disk since removed) is detached. It writes out's
// status.volumeStatus, one entry per volume (and per disk still being
// detached), and returns errHotplugPending when something is left to do.
func (h *Handler) syncHotplug(ctx context.Context, lv *launcher.Manager, vmi, out *v1.VirtualMachineInstance, dom *libvirtxml.Domain) error {
	log := h.log.With("vmi", vmi.Namespace+"/"+vmi.Name)
	live := map[string]libvirtxml.DomainDisk{}
	var taken []string
	if dom.Devices != nil {
		for _, d := range dom.Devices.Disks {
			if d.Target != nil {
				taken = append(taken, d.Target.Dev)
			}
			if d.Alias != nil && strings.HasPrefix(d.Alias.Name, "ua-") {
				live[strings.TrimPrefix(d.Alias.Name, "ua-")] = d
			}
		}
	}
	inSpec := map[string]bool{}
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		inSpec[d.Name] = true
	}
	var statuses []v1.VolumeStatus
	var pending []error

	for i := range vmi.Spec.Volumes {
		vol := &vmi.Spec.Volumes[i]
		st := v1.VolumeStatus{Name: vol.Name}
		if d, ok := live[vol.Name]; ok && d.Target != nil {
			st.Target = d.Target.Dev
		}
		if claim := claimOf(vol); claim != "" {
			st.PersistentVolumeClaimInfo = &v1.PersistentVolumeClaimInfo{ClaimName: claim}
		}
		if !domain.Hotpluggable(vol) {
			statuses = append(statuses, st)
			continue
		}
		st.HotplugVolume = &v1.HotplugVolumeStatus{}
		switch _, attached := live[vol.Name]; {
		case attached:
			st.Phase, st.Reason = v1.VolumeReady, reasonVolumeReady
			st.Message = fmt.Sprintf("Successfully attach hotplugged volume %s to VM", vol.Name)
		case !inSpec[vol.Name]:
			st.Phase, st.Reason = v1.VolumePending, reasonAttachFailed
			st.Message = fmt.Sprintf("hotplugged volume %s has no disk in spec.domain.devices.disks", vol.Name)
		default:
			target, err := h.attachHotplug(ctx, lv, vmi, vol, taken)
			switch {
			case err == nil:
				taken = append(taken, target)
				st.Target = target
				st.Phase, st.Reason = v1.VolumeReady, reasonVolumeReady
				st.Message = fmt.Sprintf("Successfully attach hotplugged volume %s to VM", vol.Name)
				log.Info("volume hotplugged", "volume", vol.Name, "target", target)
				h.recorder.Eventf(vmi, k8sv1.EventTypeNormal, reasonVolumeReady, "Successfully attach hotplugged volume %s to VM", vol.Name)
			case errors.Is(err, errWaiting):
				st.Phase, st.Reason, st.Message = v1.VolumePending, reasonVolumePending, err.Error()
				pending = append(pending, err)
			default:
				st.Phase, st.Reason, st.Message = v1.VolumePending, reasonAttachFailed, err.Error()
				if prev := volumeStatusOf(vmi, vol.Name); prev == nil || prev.Message != err.Error() {
					h.recorder.Eventf(vmi, k8sv1.EventTypeWarning, reasonAttachFailed, "Failed to attach hotplugged volume %s: %v", vol.Name, err)
				}
				log.Warn("volume hotplug", "volume", vol.Name, "err", err)
				pending = append(pending, err)
			}
		}
		statuses = append(statuses, st)
	}

	for name, d := range live {
		if inSpec[name] {
			continue
		}
		err := lv.DetachDisk(ctx, domain.Name(vmi.Namespace, vmi.Name), "ua-"+name)
		if err == nil {
			log.Info("volume unplugged", "volume", name, "target", d.Target.Dev)
			h.recorder.Eventf(vmi, k8sv1.EventTypeNormal, "VolumeDetached", "Successfully detached hotplugged volume %s", name)
			continue
		}
		log.Warn("volume unplug", "volume", name, "err", err)
		st := v1.VolumeStatus{Name: name, HotplugVolume: &v1.HotplugVolumeStatus{}, Phase: v1.HotplugVolumeDetaching,
			Reason: reasonVolumeDetached, Message: err.Error()}
		if d.Target != nil {
			st.Target = d.Target.Dev
		}
		statuses = append(statuses, st)
		pending = append(pending, err)
	}
	out.Status.VolumeStatus = statuses
	if len(pending) > 0 {
		return fmt.Errorf("%w: %w", errHotplugPending, errors.Join(pending...))
	}
	return nil
}

// attachHotplug resolves the hotplugged volume vol on this node and
// attaches its disk to the running domain; it returns the disk's target.
func (h *Handler) attachHotplug(ctx context.Context, lv *launcher.Manager, vmi *v1.VirtualMachineInstance, vol *v1.Volume, taken []string) (string, error) {
	ds, err := h.claimDisk(ctx, vmi.Namespace, claimOf(vol))
	if err != nil {
		return "", err
	}
	env := domain.Env{Emulation: h.emulation(), StateDir: h.vmDir(vmi.UID), Disks: map[string]domain.DiskSource{vol.Name: ds}}
	disk, err := domain.HotplugDisk(vmi, vol.Name, env, taken)
	if err != nil {
		return "", err
	}
	if err := lv.AttachDisk(ctx, domain.Name(vmi.Namespace, vmi.Name), disk); err != nil {
		return "", err
	}
	return disk.Target.Dev, nil
}

func volumeStatusOf(vmi *v1.VirtualMachineInstance, name string) *v1.VolumeStatus {
	for i := range vmi.Status.VolumeStatus {
		if vmi.Status.VolumeStatus[i].Name == name {
			return &vmi.Status.VolumeStatus[i]
		}
	}
	return nil
}
