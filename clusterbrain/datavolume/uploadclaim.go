package datavolume

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
)

// A bare upload claim is a PVC that carries CDI's upload-target annotation
// and belongs to no DataVolume: `virtctl image-upload pvc` makes one and
// then waits for the claim's pod.ready annotation. CDI answers with an
// upload pod; nodevirt adopts the claim as an upload, which the node that
// holds its volume then serves like a DataVolume's.

// uploadClaimKey marks a bare upload claim's key in the queue (DataVolume
// keys are plain namespace/name).
const uploadClaimKey = "upload-claim:"

// syncUploadClaim adopts one bare upload claim: it adds the keys the node
// reads (source, usable size) and, for a WaitForFirstConsumer class (no
// consumer is coming before the upload is done) or an Immediate class of
// the hostpath provisioners, picks a node with an upload endpoint. A claim
// no node can take gets a warning event saying why.
func (c *Controller) syncUploadClaim(ctx context.Context, key string) (time.Duration, error) {
	pvc, err := c.claimOf(key, uploadClaimKey)
	if err != nil || pvc == nil {
		return 0, err
	}
	if !importstate.IsBareUploadClaim(pvc) || pvc.DeletionTimestamp != nil {
		return 0, nil
	}
	if pvc.Annotations[importstate.AnnSource] == "" {
		return 0, c.adoptUploadClaim(ctx, pvc)
	}
	sc := c.storageClass(deref(pvc.Spec.StorageClassName))
	wffc := sc != nil && sc.VolumeBindingMode != nil && *sc.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer
	if pvc.Status.Phase != corev1.ClaimPending || !(wffc || placesImmediateClass(sc)) || pvc.Annotations[importstate.AnnSelectedNode] != "" {
		return 0, nil
	}
	return c.placeClaim(ctx, pvc, &cdiv1.DataVolumeSource{Upload: &cdiv1.DataVolumeSourceUpload{}}, c.workloadPlacement)
}

// placeClaim places pvc, a claim of no DataVolume, at once
// (placeImmediately); while no node can take it, a warning event on the
// claim says why and it is looked at again after retryAfter.
func (c *Controller) placeClaim(ctx context.Context, pvc *corev1.PersistentVolumeClaim, src *cdiv1.DataVolumeSource,
	workload func(context.Context, *storagev1.StorageClass) nodeplacement.Placement) (time.Duration, error) {
	err := c.placeImmediately(ctx, pvc, src, workload)
	var ce *claimError
	if errors.As(err, &ce) {
		c.log.Info("cannot place claim yet", "namespace", pvc.Namespace, "pvc", pvc.Name, "source", sourceKind(src), "reason", ce.reason, "err", err)
		// Retried every few seconds: the recorder folds the repeats into
		// one event's count.
		c.recorder.Event(pvc, corev1.EventTypeWarning, ce.reason, ce.Error())
		return retryAfter, nil
	}
	return 0, err
}

// claimOf is the cached claim a claim key of the queue names (after its
// prefix), nil when it is gone.
func (c *Controller) claimOf(key, prefix string) (*corev1.PersistentVolumeClaim, error) {
	ns, name, _ := strings.Cut(strings.TrimPrefix(key, prefix), "/")
	pvc, err := c.pvcs.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	return pvc, err
}

// adoptUploadClaim writes the upload source and the usable size (the
// request, net of the filesystem overhead for a filesystem volume).
func (c *Controller) adoptUploadClaim(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	size, ok := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if !ok || size.Value() <= 0 {
		return nil // the API server refuses such a claim; nothing to adopt
	}
	usable := size.Value()
	if pvc.Spec.VolumeMode == nil || *pvc.Spec.VolumeMode == corev1.PersistentVolumeFilesystem {
		usable = importstate.UsableOf(usable, c.filesystemOverhead(ctx, deref(pvc.Spec.StorageClassName)))
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		importstate.AnnSource:     importstate.SourceUpload,
		importstate.AnnUsableSize: strconv.FormatInt(usable, 10),
	}}})
	if err != nil {
		return err
	}
	_, err = c.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return fmt.Errorf("adopt upload claim %s/%s: %w", pvc.Namespace, pvc.Name, err)
	}
	c.log.Info("adopted bare upload claim", "namespace", pvc.Namespace, "pvc", pvc.Name, "usableBytes", usable)
	return nil
}
