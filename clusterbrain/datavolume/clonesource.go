package datavolume

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// checkAuthorized says whether dv may clone src (its resolved source):
// a source in another namespace must be the one the DataVolume webhook
// authorized and stamped (AnnAuthorizedSource); a stamp that names another
// source (a DataSource retargeted since) fails the DataVolume too.
func checkAuthorized(dv *cdiv1.DataVolume, src *cdiv1.DataVolumeSource) error {
	var kind, ns, name string
	switch {
	case src == nil:
		return nil
	case src.PVC != nil:
		kind, ns, name = kindPVCSource, src.PVC.Namespace, src.PVC.Name
	case src.Snapshot != nil:
		kind, ns, name = kindSnapshotSource, src.Snapshot.Namespace, src.Snapshot.Name
	default:
		return nil
	}
	want := kind + "/" + ns + "/" + name
	stamp, stamped := dv.Annotations[AnnAuthorizedSource]
	switch {
	case stamped && stamp != want:
		return &claimError{reason: "CloneSourceChanged", fatal: true, err: fmt.Errorf(
			"the source now resolves to %s but the creator of the datavolume was authorized for %s", want, stamp)}
	case !stamped && ns != dv.Namespace:
		return &claimError{reason: "CloneNotAuthorized", fatal: true, err: fmt.Errorf(
			"cloning %s from namespace %s was not authorized when the datavolume was created (create on datavolumes/source in %s is required)", want, ns, ns)}
	}
	return nil
}

// cloneRequestOf is the clone request of pvc, filled from src: a clone of
// a claim, or the restore of a VolumeSnapshot of another namespace (the
// claim cannot name it: a cross-namespace dataSourceRef needs an API server
// feature gate and a ReferenceGrant). ok is false for other sources.
func cloneRequestOf(pvc *corev1.PersistentVolumeClaim, src *cdiv1.DataVolumeSource) (importstate.CloneRequest, bool) {
	req := importstate.CloneRequest{TargetNamespace: pvc.Namespace, TargetName: pvc.Name}
	switch {
	case src != nil && src.PVC != nil:
		req.SourceNamespace, req.SourceName, req.SourceKind = src.PVC.Namespace, src.PVC.Name, importstate.CloneSourceClaim
	case src != nil && src.Snapshot != nil && src.Snapshot.Namespace != pvc.Namespace:
		req.SourceNamespace, req.SourceName, req.SourceKind = src.Snapshot.Namespace, src.Snapshot.Name, importstate.CloneSourceSnapshot
	default:
		return req, false
	}
	return req, true
}

// ensureCloneRequest writes req, the clone request of pvc, in the brain's
// namespace, where only the brain writes: the nodes take the source from
// there, never from the claim's annotations.
func (c *Controller) ensureCloneRequest(ctx context.Context, pvc *corev1.PersistentVolumeClaim, req importstate.CloneRequest) error {
	name := importstate.CloneRequestName(pvc.UID)
	cms := c.kube.CoreV1().ConfigMaps(c.cfg.Namespace)
	cur, err := cms.Get(ctx, name, metav1.GetOptions{})
	if err == nil {
		if got, rerr := importstate.ReadCloneRequest(cur, pvc); rerr == nil && got == req {
			return nil
		}
		cur = cur.DeepCopy()
		cur.Data = req.Data()
		if _, err := cms.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("update clone request %s: %w", name, err)
		}
		return nil
	}
	if !apierrors.IsNotFound(err) {
		return fmt.Errorf("read clone request %s: %w", name, err)
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: c.cfg.Namespace,
		Labels: map[string]string{importstate.CloneRequestLabel: "", "app.kubernetes.io/managed-by": "nodevirt"}}, Data: req.Data()}
	if _, err := cms.Create(ctx, cm, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create clone request %s: %w", name, err)
	}
	c.log.Info("clone requested", "namespace", pvc.Namespace, "pvc", pvc.Name, "source", req.SourceNamespace+"/"+req.SourceName, "kind", req.SourceKind)
	return nil
}

// deleteCloneRequest removes the clone request of pvc (gone is fine).
func (c *Controller) deleteCloneRequest(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	err := c.kube.CoreV1().ConfigMaps(c.cfg.Namespace).Delete(ctx, importstate.CloneRequestName(pvc.UID), metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete clone request of pvc %s/%s: %w", pvc.Namespace, pvc.Name, err)
	}
	return nil
}

// collectCloneRequests deletes, every interval, the clone requests whose
// claim is gone (its DataVolume deleted before the clone ended).
func (c *Controller) collectCloneRequests(ctx context.Context, interval time.Duration) {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		list, err := c.kube.CoreV1().ConfigMaps(c.cfg.Namespace).List(ctx, metav1.ListOptions{LabelSelector: importstate.CloneRequestLabel})
		if err != nil {
			c.log.Warn("list clone requests", "err", err)
			return
		}
		for i := range list.Items {
			cm := &list.Items[i]
			if time.Since(cm.CreationTimestamp.Time) < interval {
				continue // its claim may not be in the cache yet
			}
			ns, name, _ := strings.Cut(cm.Data[importstate.CloneTargetKey], "/")
			pvc, err := c.pvcs.PersistentVolumeClaims(ns).Get(name)
			if err == nil && importstate.CloneRequestName(pvc.UID) == cm.Name {
				continue
			}
			if err != nil && !apierrors.IsNotFound(err) {
				continue
			}
			if err := c.kube.CoreV1().ConfigMaps(c.cfg.Namespace).Delete(ctx, cm.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				c.log.Warn("delete stale clone request", "configmap", cm.Name, "err", err)
			}
		}
	}, interval)
}
