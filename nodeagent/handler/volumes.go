package handler

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	k8sv1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// DiskImageName is the VM disk inside a filesystem volume, as KubeVirt and
// CDI name it.
const DiskImageName = "disk.img"

// errWaiting marks a start that cannot proceed yet (a claim not bound, a
// disk still importing, a missing Secret or network) and will be retried.
var errWaiting = errors.New("waiting")

// resolveDisks finds the node disk of every persistentVolumeClaim,
// dataVolume and ephemeral volume of vmi.
func (h *Handler) resolveDisks(ctx context.Context, vmi *v1.VirtualMachineInstance) (map[string]domain.DiskSource, error) {
	return h.resolveDisksExcept(ctx, vmi, nil)
}

// resolveDisksExcept is resolveDisks leaving out the volumes named in skip.
func (h *Handler) resolveDisksExcept(ctx context.Context, vmi *v1.VirtualMachineInstance, skip map[string]bool) (map[string]domain.DiskSource, error) {
	disks := map[string]domain.DiskSource{}
	for i, vol := range vmi.Spec.Volumes {
		if skip[vol.Name] {
			continue
		}
		var claim string
		switch s := vol.VolumeSource; {
		case s.PersistentVolumeClaim != nil:
			claim = s.PersistentVolumeClaim.ClaimName
		case s.DataVolume != nil:
			// CDI's DataVolume owns a PVC of the same name.
			claim = s.DataVolume.Name
		case s.Ephemeral != nil && s.Ephemeral.PersistentVolumeClaim != nil:
			claim = s.Ephemeral.PersistentVolumeClaim.ClaimName
		default:
			continue
		}
		ds, err := h.claimDisk(ctx, vmi.Namespace, claim)
		if err != nil {
			return nil, fmt.Errorf("spec.volumes[%d] (%s): %w", i, vol.Name, err)
		}
		disks[vol.Name] = ds
	}
	return disks, nil
}

// claimDisk follows a PVC to its PV and the PV to the disk on this node.
func (h *Handler) claimDisk(ctx context.Context, namespace, claim string) (domain.DiskSource, error) {
	pvc, err := h.cfg.Kube.CoreV1().PersistentVolumeClaims(namespace).Get(ctx, claim, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return domain.DiskSource{}, fmt.Errorf("%w: persistentvolumeclaim %s/%s does not exist", errWaiting, namespace, claim)
	}
	if err != nil {
		return domain.DiskSource{}, fmt.Errorf("persistentvolumeclaim %s/%s: %w", namespace, claim, err)
	}
	if pvc.Spec.VolumeName == "" {
		return domain.DiskSource{}, fmt.Errorf("%w: persistentvolumeclaim %s/%s is not bound", errWaiting, namespace, claim)
	}
	pv, err := h.cfg.Kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		return domain.DiskSource{}, fmt.Errorf("persistentvolume %s of claim %s/%s: %w", pvc.Spec.VolumeName, namespace, claim, err)
	}
	var path string
	var block bool
	switch s := pv.Spec.PersistentVolumeSource; {
	case s.CSI != nil:
		if h.cfg.Volumes == nil {
			return domain.DiskSource{}, fmt.Errorf("persistentvolume %s is a CSI volume of driver %s, and this node agent has no CSI volume resolver", pv.Name, s.CSI.Driver)
		}
		path, block, err = h.cfg.Volumes.VolumeDisk(s.CSI.VolumeHandle)
		if err != nil {
			return domain.DiskSource{}, fmt.Errorf("persistentvolume %s (volume %s): %w", pv.Name, s.CSI.VolumeHandle, err)
		}
	case s.HostPath != nil:
		path, block, err = hostDisk(s.HostPath.Path)
	case s.Local != nil:
		path, block, err = hostDisk(s.Local.Path)
	default:
		return domain.DiskSource{}, fmt.Errorf("persistentvolume %s: only CSI, hostPath and local volumes can back a VM disk on a node", pv.Name)
	}
	if err != nil {
		return domain.DiskSource{}, fmt.Errorf("persistentvolume %s: %w", pv.Name, err)
	}
	// The format is the one the volume was filled with, never read from
	// its bytes: a guest writes what it likes into its own disk, and a
	// qcow2 header it wrote (naming a backing file on the host) must not
	// change how the node opens the disk at the next start.
	ds := domain.DiskSource{Path: path, Block: block, Format: VolumeFormat}
	if !block {
		if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
			return domain.DiskSource{}, fmt.Errorf("%w: persistentvolume %s has no %s yet (import not finished?)", errWaiting, pv.Name, DiskImageName)
		} else if err != nil {
			return domain.DiskSource{}, fmt.Errorf("persistentvolume %s: %w", pv.Name, err)
		}
	}
	return ds, nil
}

// VolumeFormat is the format of every volume's disk. It is recorded by
// what fills volumes, not stored per volume: the importer, uploads,
// clones (byte copies), snapshot restores (byte copies) and blank disks
// all write raw. A per-volume record could not live on the claim (its
// annotations are the tenant's to edit); should a filler ever write
// another format, the record belongs with the node's volume state.
const VolumeFormat = domain.FormatRaw

// hostDisk maps a hostPath/local PV path to the VM disk: the block device
// itself, a file as is, or disk.img inside a directory.
func hostDisk(path string) (string, bool, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", false, err
	}
	switch {
	case st.Mode()&fs.ModeDevice != 0 && st.Mode()&fs.ModeCharDevice == 0:
		return path, true, nil
	case st.IsDir():
		return filepath.Join(path, DiskImageName), false, nil
	default:
		return path, false, nil
	}
}

// vmiRef names vmi as the referrer of what it reads through the brain.
func vmiRef(vmi *v1.VirtualMachineInstance) nodereads.Ref {
	return nodereads.Ref{Resource: nodereads.VMIs, Namespace: vmi.Namespace, Name: vmi.Name}
}

// resolveSecrets reads the Secrets the cloud-init and secret volumes refer
// to. A missing optional Secret is left out: its disk is made empty.
func (h *Handler) resolveSecrets(ctx context.Context, vmi *v1.VirtualMachineInstance) (map[string]map[string][]byte, error) {
	out := map[string]map[string][]byte{}
	for _, vol := range vmi.Spec.Volumes {
		var refs []*k8sv1.LocalObjectReference
		if s := vol.CloudInitNoCloud; s != nil {
			refs = append(refs, s.UserDataSecretRef, s.NetworkDataSecretRef)
		}
		if s := vol.CloudInitConfigDrive; s != nil {
			refs = append(refs, s.UserDataSecretRef, s.NetworkDataSecretRef)
		}
		optional := false
		if s := vol.Secret; s != nil {
			refs = append(refs, &k8sv1.LocalObjectReference{Name: s.SecretName})
			optional = s.Optional != nil && *s.Optional
		}
		for _, ref := range refs {
			if ref == nil || out[ref.Name] != nil {
				continue
			}
			sec, err := h.cfg.Reads.Secret(ctx, vmiRef(vmi), ref.Name)
			if apierrors.IsNotFound(err) && optional {
				continue
			}
			if apierrors.IsNotFound(err) {
				return nil, fmt.Errorf("%w: volume %s: secret %s/%s does not exist", errWaiting, vol.Name, vmi.Namespace, ref.Name)
			}
			if err != nil {
				return nil, fmt.Errorf("volume %s: secret %s/%s: %w", vol.Name, vmi.Namespace, ref.Name, err)
			}
			out[ref.Name] = sec.Data
		}
	}
	return out, nil
}

// resolveConfigMaps reads the ConfigMaps the configMap volumes refer to,
// text and binary keys alike. A missing optional ConfigMap is left out.
func (h *Handler) resolveConfigMaps(ctx context.Context, vmi *v1.VirtualMachineInstance) (map[string]map[string][]byte, error) {
	out := map[string]map[string][]byte{}
	for _, vol := range vmi.Spec.Volumes {
		src := vol.ConfigMap
		if src == nil || out[src.Name] != nil {
			continue
		}
		cm, err := h.cfg.Reads.ConfigMap(ctx, vmiRef(vmi), src.Name)
		if apierrors.IsNotFound(err) && src.Optional != nil && *src.Optional {
			continue
		}
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("%w: volume %s: configMap %s/%s does not exist", errWaiting, vol.Name, vmi.Namespace, src.Name)
		}
		if err != nil {
			return nil, fmt.Errorf("volume %s: configMap %s/%s: %w", vol.Name, vmi.Namespace, src.Name, err)
		}
		data := make(map[string][]byte, len(cm.Data)+len(cm.BinaryData))
		for k, v := range cm.Data {
			data[k] = []byte(v)
		}
		for k, v := range cm.BinaryData {
			data[k] = v
		}
		out[src.Name] = data
	}
	return out, nil
}
