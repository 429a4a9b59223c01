package provisioner

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	hostpath "github.com/nodevirt/nodevirt/csi"
)

var everything = labels.Everything()

// Event reasons, the ones external-provisioner uses where they exist.
const (
	reasonProvisioning       = "Provisioning"
	reasonProvisioned        = "ProvisioningSucceeded"
	reasonProvisioningFailed = "ProvisioningFailed"
	reasonDeleteFailed       = "VolumeFailedDelete"
	reasonDeleted            = "VolumeDeleted"
)

// syncClaim provisions the claim at key (namespace/name) if it is this
// node's to provision and has no PV yet.
func (p *Provisioner) syncClaim(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil // a malformed key never becomes valid
	}
	log := p.log.With("namespace", ns, "claim", name)
	pvc, err := p.claims.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	sc, err := p.classes.Get(storageClassName(pvc))
	if apierrors.IsNotFound(err) {
		sc = nil
	} else if err != nil {
		return err
	}
	plan := planClaim(pvc, sc, p.cfg.NodeName)
	if !plan.Provision {
		log.Debug("not provisioning", "reason", plan.Reason)
		return nil
	}
	if plan.Err != nil {
		p.recorder.Event(pvc, corev1.EventTypeWarning, reasonProvisioningFailed, plan.Err.Error())
		log.Warn("cannot provision", "err", plan.Err)
		return nil
	}
	pvName := volumeName(pvc)
	if _, err := p.volumes.Get(pvName); err == nil {
		return nil // provisioned already; the PV controller binds it
	}
	return p.provision(ctx, pvc, sc, plan.Kind)
}

func (p *Provisioner) provision(ctx context.Context, pvc *corev1.PersistentVolumeClaim, sc *storagev1.StorageClass, k kind) error {
	log := p.log.With("namespace", pvc.Namespace, "claim", pvc.Name)
	fail := func(err error) error {
		p.recorder.Event(pvc, corev1.EventTypeWarning, reasonProvisioningFailed, err.Error())
		return fmt.Errorf("provision %s/%s: %w", pvc.Namespace, pvc.Name, err)
	}
	sourceID, err := p.cloneSourceVolume(pvc)
	if err != nil {
		return fail(err)
	}
	snapshotID, err := p.sourceSnapshot(ctx, pvc)
	var refused *refusal
	if errors.As(err, &refused) {
		// Waiting changes nothing: the claim must change.
		p.recorder.Event(pvc, corev1.EventTypeWarning, reasonProvisioningFailed, err.Error())
		log.Warn("cannot restore", "err", err)
		return nil
	}
	if err != nil {
		return fail(err)
	}
	req, err := createRequest(pvc, sc, p.cfg.NodeName, sourceID, snapshotID)
	if err != nil {
		return fail(err)
	}
	p.recorder.Eventf(pvc, corev1.EventTypeNormal, reasonProvisioning,
		"provisioner %s on node %s is provisioning a volume for claim %s/%s", k.provisionerName(), p.cfg.NodeName, pvc.Namespace, pvc.Name)
	resp, err := p.cfg.Driver.CreateVolume(ctx, req)
	if err != nil {
		return fail(fmt.Errorf("create volume: %w", err))
	}
	made := madeVolume{
		ID:            resp.GetVolume().GetVolumeId(),
		CapacityBytes: resp.GetVolume().GetCapacityBytes(),
		Context:       resp.GetVolume().GetVolumeContext(),
	}
	if k == kindLegacy {
		if made.Path, err = p.cfg.Driver.VolumePath(made.ID); err != nil {
			return fail(fmt.Errorf("volume path: %w", err))
		}
	}
	pv := buildPV(pvc, sc, p.cfg.NodeName, k, made)
	_, err = p.cfg.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fail(fmt.Errorf("create persistent volume: %w", err))
	}
	p.recorder.Eventf(pvc, corev1.EventTypeNormal, reasonProvisioned, "Successfully provisioned volume %s", pv.Name)
	log.Info("provisioned", "volume", pv.Name, "volumeID", made.ID, "bytes", made.CapacityBytes, "provisioner", k.provisionerName())
	return nil
}

// cloneSourceVolume resolves a claim data source to the driver volume it
// names; it must be one of this node's volumes.
func (p *Provisioner) cloneSourceVolume(pvc *corev1.PersistentVolumeClaim) (string, error) {
	src := cloneSource(pvc)
	if src == "" {
		return "", nil
	}
	srcPVC, err := p.claims.PersistentVolumeClaims(pvc.Namespace).Get(src)
	if err != nil {
		return "", fmt.Errorf("clone source claim %s: %w", src, err)
	}
	if srcPVC.Spec.VolumeName == "" {
		return "", fmt.Errorf("clone source claim %s is not bound yet", src)
	}
	pv, err := p.volumes.Get(srcPVC.Spec.VolumeName)
	if err != nil {
		return "", fmt.Errorf("clone source volume %s: %w", srcPVC.Spec.VolumeName, err)
	}
	id, ours := pvVolume(pv, p.cfg.NodeName)
	if !ours {
		return "", fmt.Errorf("clone source claim %s is not a hostpath volume on node %s", src, p.cfg.NodeName)
	}
	return id, nil
}

// refusal is a reason a claim cannot be provisioned until it changes.
type refusal struct{ err error }

func (r *refusal) Error() string { return r.err.Error() }
func (r *refusal) Unwrap() error { return r.err }

// sourceSnapshot resolves a VolumeSnapshot data source to the CSI snapshot
// it names, which must be ready, on this node, and no larger than the
// claim.
func (p *Provisioner) sourceSnapshot(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (string, error) {
	namespace, name := pvc.Namespace, snapshotSource(pvc)
	if name == "" && pvc.Annotations[importstate.AnnSource] == importstate.SourceSnapshot {
		var err error
		if namespace, name, err = p.crossNamespaceSnapshot(ctx, pvc); err != nil {
			return "", err
		}
	}
	if name == "" {
		return "", nil
	}
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return "", &refusal{fmt.Errorf("volumesnapshot name %q is not valid: %s", name, strings.Join(errs, "; "))}
	}
	if p.cfg.Snapshots == nil {
		return "", &refusal{fmt.Errorf("volumesnapshot %s: this provisioner has no snapshot client", name)}
	}
	loc, err := p.cfg.Snapshots.Locate(ctx, namespace, name)
	if err != nil {
		return "", fmt.Errorf("restore source: %w", err)
	}
	switch {
	case loc.Driver != hostpath.DriverName:
		return "", &refusal{fmt.Errorf("volumesnapshot %s/%s belongs to driver %s, not %s", namespace, name, loc.Driver, hostpath.DriverName)}
	case loc.Node != p.cfg.NodeName:
		return "", &refusal{fmt.Errorf("volumesnapshot %s/%s is held by node %q, the claim is selected for node %s", namespace, name, loc.Node, p.cfg.NodeName)}
	case !loc.Ready:
		return "", fmt.Errorf("volumesnapshot %s/%s is not ready to use yet", namespace, name)
	}
	if size, err := requestedBytes(pvc); err == nil && loc.RestoreSize > size {
		return "", &refusal{fmt.Errorf("requested size %d bytes is smaller than the restore size %d bytes of volumesnapshot %s/%s",
			size, loc.RestoreSize, namespace, name)}
	}
	return loc.Handle, nil
}

// crossNamespaceSnapshot is the VolumeSnapshot of another namespace that a
// DataVolume's claim restores: the claim names no source (a
// cross-namespace dataSourceRef needs an API server feature gate), only
// that it is a snapshot restore; the brain, having checked CDI's rule,
// names the snapshot in the claim's clone request, which users cannot
// write. Without that request nothing is restored.
func (p *Provisioner) crossNamespaceSnapshot(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (namespace, name string, err error) {
	if p.cfg.Reads == nil {
		return "", "", &refusal{fmt.Errorf("claim %s/%s restores a snapshot the brain names: this provisioner cannot read the brain's requests", pvc.Namespace, pvc.Name)}
	}
	ref := nodereads.Ref{Resource: nodereads.Claims, Namespace: pvc.Namespace, Name: pvc.Name}
	cm, err := p.cfg.Reads.BrainConfigMap(ctx, ref, importstate.CloneRequestName(pvc.UID))
	if err != nil {
		// The brain writes it just after the claim: retried.
		return "", "", fmt.Errorf("restore request of claim %s/%s: %w", pvc.Namespace, pvc.Name, err)
	}
	req, err := importstate.ReadCloneRequest(cm, pvc)
	if err != nil {
		return "", "", &refusal{err}
	}
	if req.SourceKind != importstate.CloneSourceSnapshot {
		return "", "", &refusal{fmt.Errorf("the clone request of claim %s/%s names a %s, not a VolumeSnapshot", pvc.Namespace, pvc.Name, req.SourceKind)}
	}
	return req.SourceNamespace, req.SourceName, nil
}

// syncVolume deletes a released volume of ours per its reclaim policy.
func (p *Provisioner) syncVolume(ctx context.Context, name string) error {
	pv, err := p.volumes.Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	id, ours := pvVolume(pv, p.cfg.NodeName)
	if !ours {
		return nil
	}
	log := p.log.With("volume", name, "volumeID", id)
	switch planVolume(pv) {
	case keepVolume:
		return nil
	case releaseFinalizer:
		log.Info("volume retained")
		return p.removeFinalizer(ctx, pv)
	}
	if _, err := p.cfg.Driver.DeleteVolume(ctx, &csispec.DeleteVolumeRequest{VolumeId: id}); err != nil {
		p.recorder.Eventf(pv, corev1.EventTypeWarning, reasonDeleteFailed, "delete volume %s: %v", id, err)
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	if err := p.removeFinalizer(ctx, pv); err != nil {
		return err
	}
	if pv.DeletionTimestamp == nil {
		err := p.cfg.Client.CoreV1().PersistentVolumes().Delete(ctx, name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete persistent volume %s: %w", name, err)
		}
	}
	p.recorder.Eventf(pv, corev1.EventTypeNormal, reasonDeleted, "deleted volume %s of released claim", id)
	log.Info("volume deleted", "reclaimPolicy", pv.Spec.PersistentVolumeReclaimPolicy)
	return nil
}

func (p *Provisioner) removeFinalizer(ctx context.Context, pv *corev1.PersistentVolume) error {
	if !hasFinalizer(pv) {
		return nil
	}
	c := pv.DeepCopy()
	c.Finalizers = slices.DeleteFunc(c.Finalizers, func(f string) bool { return f == Finalizer })
	_, err := p.cfg.Client.CoreV1().PersistentVolumes().Update(ctx, c, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove finalizer of %s: %w", pv.Name, err)
	}
	return nil
}
