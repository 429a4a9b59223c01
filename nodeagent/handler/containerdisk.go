package handler

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"

	k8sv1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/nodeagent/containerdisk"
)

// ContainerDiskDir is where, inside Config.StateDir, pulled containerDisk
// images are cached (package containerdisk). It holds no handler record,
// so the handler never takes it for a VMI's state.
const ContainerDiskDir = "containerdisks"

// containerDisks returns the node's containerDisk image cache, made on
// first use under Config.StateDir.
func (h *Handler) containerDisks() (*containerdisk.Puller, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cdisks != nil {
		return h.cdisks, nil
	}
	p, err := containerdisk.New(containerdisk.Config{Dir: filepath.Join(h.cfg.StateDir, ContainerDiskDir), Log: h.cfg.Log})
	if err != nil {
		return nil, err
	}
	// Users recorded by an earlier run for VMIs that are gone and left no
	// state (deleted while their image was pulled) are forgotten now.
	live := map[string]bool{}
	for _, o := range h.vmis.GetStore().List() {
		if vmi, ok := o.(*v1.VirtualMachineInstance); ok {
			live[string(vmi.UID)] = true
		}
	}
	if err := p.Retain(func(uid string) bool { return live[uid] || h.owns(types.UID(uid)) }); err != nil {
		h.log.Warn("containerDisk image cache", "err", err)
	}
	h.cdisks = p
	return p, nil
}

// resolveContainerDisks adds the cached image of every containerDisk
// volume of vmi to disks. An image not cached yet is pulled in the
// background: the VMI waits (errWaiting, phase Scheduled) and is
// reconciled again when the pull is over. A failed pull is a
// *containerdisk.PullError, retried after the cache's back-off.
func (h *Handler) resolveContainerDisks(ctx context.Context, vmi *v1.VirtualMachineInstance, disks map[string]domain.DiskSource) error {
	var insecure []string
	var allowed []netip.Prefix
	var cache *containerdisk.Puller
	key := vmi.Namespace + "/" + vmi.Name
	for i, vol := range vmi.Spec.Volumes {
		cd := vol.ContainerDisk
		if cd == nil {
			continue
		}
		if cache == nil {
			var err error
			if cache, err = h.containerDisks(); err != nil {
				return err
			}
			insecure, allowed = h.importNetworks(ctx)
		}
		req := containerdisk.Request{Image: cd.Image, PullPolicy: cd.ImagePullPolicy, Path: cd.Path,
			InsecureRegistries: insecure, AllowedNetworks: allowed}
		if cd.ImagePullSecret != "" {
			sec, err := h.pullSecret(ctx, vmi, cd.ImagePullSecret)
			if err != nil {
				return fmt.Errorf("spec.volumes[%d] (%s): %w", i, vol.Name, err)
			}
			req.PullSecret = sec
		}
		img, err := cache.Acquire(ctx, req, string(vmi.UID), func() {
			if h.queue != nil {
				h.queue.Add(key)
			}
		})
		if errors.Is(err, containerdisk.ErrPulling) {
			return fmt.Errorf("%w: spec.volumes[%d] (%s): %w", errWaiting, i, vol.Name, err)
		}
		if err != nil {
			return fmt.Errorf("spec.volumes[%d] (%s): %w", i, vol.Name, err)
		}
		disks[vol.Name] = domain.DiskSource{Path: img.Path, Format: domain.FormatRaw}
	}
	return nil
}

// pullSecret reads a kubernetes.io/dockerconfigjson (or legacy dockercfg)
// Secret.
func (h *Handler) pullSecret(ctx context.Context, vmi *v1.VirtualMachineInstance, name string) ([]byte, error) {
	namespace := vmi.Namespace
	sec, err := h.cfg.Reads.Secret(ctx, vmiRef(vmi), name)
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("%w: imagePullSecret %s/%s does not exist", errWaiting, namespace, name)
	}
	if err != nil {
		return nil, fmt.Errorf("imagePullSecret %s/%s: %w", namespace, name, err)
	}
	if b, ok := sec.Data[k8sv1.DockerConfigJsonKey]; ok {
		return b, nil
	}
	if b, ok := sec.Data[k8sv1.DockerConfigKey]; ok {
		return b, nil
	}
	return nil, fmt.Errorf("%w: imagePullSecret %s/%s has neither %s nor %s", errSpec, namespace, name,
		k8sv1.DockerConfigJsonKey, k8sv1.DockerConfigKey)
}

// importNetworks reads what the CDI CR says about registries: the
// configuration's insecure registries, as the DataVolume importer uses
// them, and the networks pulls may reach although they are forbidden by
// default (importstate.AnnImportAllowedNetworks). Both are empty when
// there is no CDI CR or it cannot be read; an unparsable annotation
// allows nothing.
func (h *Handler) importNetworks(ctx context.Context) ([]string, []netip.Prefix) {
	cdi, err := h.cfg.Virt.CDI(ctx)
	if err != nil {
		h.log.Debug("cdi configuration unreadable, no insecure registries", "err", err)
	}
	if cdi == nil {
		return nil, nil
	}
	var insecure []string
	if cdi.Spec.Config != nil {
		insecure = cdi.Spec.Config.InsecureRegistries
	}
	allowed, err := reach.ParseNetworks(cdi.Annotations[importstate.AnnImportAllowedNetworks])
	if err != nil {
		h.log.Warn("cdi annotation unparsable, pulls reach no forbidden network", "annotation", importstate.AnnImportAllowedNetworks, "err", err)
	}
	return insecure, allowed
}

// releaseContainerDisks forgets the VMI uid as a user of cached images;
// images nobody uses are removed after the cache's keep time.
func (h *Handler) releaseContainerDisks(uid string) error {
	cache, err := h.containerDisks()
	if err != nil {
		return err
	}
	if err := cache.Release(uid); err != nil {
		return fmt.Errorf("containerDisk images of vmi %s: %w", uid, err)
	}
	return nil
}

// pullReason is the Synchronized condition's reason for a failed
// containerDisk pull (kubelet's ErrImagePull, ImagePullBackOff, ...), or
// "" when err is no pull failure.
func pullReason(err error) string {
	var pe *containerdisk.PullError
	if errors.As(err, &pe) {
		return pe.Reason
	}
	return ""
}

// pullEvent records a Warning Event on vmi naming the image and error
// when err is a failed containerDisk pull, as kubelet does on a pod.
func (h *Handler) pullEvent(vmi *v1.VirtualMachineInstance, err error) {
	var pe *containerdisk.PullError
	if !errors.As(err, &pe) {
		return
	}
	if pe.Reason == containerdisk.ReasonImagePullBackOff {
		h.recorder.Eventf(vmi, k8sv1.EventTypeWarning, pe.Reason, "Back-off pulling containerDisk image %q: %v", pe.Image, pe.Err)
		return
	}
	h.recorder.Eventf(vmi, k8sv1.EventTypeWarning, pe.Reason, "Failed to pull containerDisk image %q: %v", pe.Image, pe.Err)
}

// pulling reports whether err only says that an image pull is under way
// (its end queues the VMI again).
func pulling(err error) bool { return errors.Is(err, containerdisk.ErrPulling) }

func hasContainerDisk(vmi *v1.VirtualMachineInstance) bool {
	for _, vol := range vmi.Spec.Volumes {
		if vol.ContainerDisk != nil {
			return true
		}
	}
	return false
}
