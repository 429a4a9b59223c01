package snapshotter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	hostpath "github.com/nodevirt/nodevirt/csi"
)

// Event reasons, external-snapshotter's where it has them.
const (
	reasonCreating     = "CreatingSnapshot"
	reasonCreated      = "SnapshotCreated"
	reasonReady        = "SnapshotReady"
	reasonFailed       = "SnapshotCreationFailed"
	reasonBindFailed   = "SnapshotBindFailed"
	reasonDeleteFailed = "SnapshotDeleteError"
	reasonDeleted      = "SnapshotDeleted"
)

// csiParamPrefix marks class parameters meant for sidecars, not the driver.
const csiParamPrefix = "csi.storage.k8s.io/"

// ContentName is the VolumeSnapshotContent made for a dynamic snapshot,
// named as the snapshot-controller names it.
func ContentName(vs *snapshotv1.VolumeSnapshot) string { return "snapcontent-" + string(vs.UID) }

// csiSnapshotName is the CSI name of a dynamic snapshot (idempotency key).
func csiSnapshotName(vs *snapshotv1.VolumeSnapshot) string { return "snapshot-" + string(vs.UID) }

func (s *Snapshotter) cachedSnapshot(key string) (*snapshotv1.VolumeSnapshot, error) {
	obj, exists, err := s.snapshots.GetIndexer().GetByKey(key)
	if err != nil || !exists {
		return nil, err
	}
	return obj.(*snapshotv1.VolumeSnapshot).DeepCopy(), nil
}

func (s *Snapshotter) cachedContent(name string) (*snapshotv1.VolumeSnapshotContent, error) {
	obj, exists, err := s.contents.GetIndexer().GetByKey(name)
	if err != nil || !exists {
		return nil, err
	}
	return obj.(*snapshotv1.VolumeSnapshotContent).DeepCopy(), nil
}

// syncSnapshot takes, binds or releases the VolumeSnapshot at key.
func (s *Snapshotter) syncSnapshot(ctx context.Context, key string) error {
	vs, err := s.cachedSnapshot(key)
	if err != nil || vs == nil {
		return err
	}
	if vs.DeletionTimestamp != nil {
		return s.releaseSnapshot(ctx, vs)
	}
	src := vs.Spec.Source
	switch {
	case src.PersistentVolumeClaimName != nil && src.VolumeSnapshotContentName != nil,
		src.PersistentVolumeClaimName == nil && src.VolumeSnapshotContentName == nil:
		return s.snapshotError(ctx, vs, reasonFailed,
			errors.New("spec.source must name exactly one of persistentVolumeClaimName and volumeSnapshotContentName"))
	case src.PersistentVolumeClaimName != nil:
		return s.takeSnapshot(ctx, vs, *src.PersistentVolumeClaimName)
	default:
		return s.bindPreProvisioned(ctx, vs, *src.VolumeSnapshotContentName)
	}
}

// localVolume returns the CSI volume of claim ns/name when it is bound to a
// hostpath volume of this node.
func (s *Snapshotter) localVolume(ns, name string) (handle string, mode *corev1.PersistentVolumeMode, ours bool, err error) {
	pvc, err := s.claims.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return "", nil, false, nil
	}
	if err != nil || pvc.Spec.VolumeName == "" {
		return "", nil, false, err
	}
	pv, err := s.volumes.Get(pvc.Spec.VolumeName)
	if apierrors.IsNotFound(err) {
		return "", nil, false, nil
	}
	if err != nil {
		return "", nil, false, err
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != hostpath.DriverName || importstate.PVNode(pv) != s.cfg.NodeName {
		return "", nil, false, nil
	}
	return pv.Spec.CSI.VolumeHandle, pv.Spec.VolumeMode, true, nil
}

// takeSnapshot provisions a dynamic snapshot of the claim named claim.
func (s *Snapshotter) takeSnapshot(ctx context.Context, vs *snapshotv1.VolumeSnapshot, claim string) error {
	handle, mode, ours, err := s.localVolume(vs.Namespace, claim)
	if err != nil || !ours {
		return err
	}
	log := s.log.With("namespace", vs.Namespace, "volumesnapshot", vs.Name)
	class, err := s.class(vs.Spec.VolumeSnapshotClassName)
	if err != nil {
		return s.snapshotError(ctx, vs, reasonFailed, err)
	}
	if class.Driver != hostpath.DriverName {
		return nil // another driver's snapshotter takes it
	}
	if vs, err = s.addSnapshotFinalizer(ctx, vs); err != nil {
		return err
	}
	content, err := s.ensureContent(ctx, vs, class, handle, mode)
	if err != nil {
		return s.snapshotError(ctx, vs, reasonFailed, fmt.Errorf("create volumesnapshotcontent: %w", err))
	}
	if content.Status == nil || content.Status.SnapshotHandle == nil {
		s.recorder.Eventf(vs, corev1.EventTypeNormal, reasonCreating, "Waiting for a snapshot %s/%s to be created by the CSI driver.", vs.Namespace, vs.Name)
		params := map[string]string{}
		for k, v := range class.Parameters {
			if !strings.HasPrefix(k, csiParamPrefix) {
				params[k] = v
			}
		}
		resp, err := s.cfg.Driver.CreateSnapshot(ctx, &csispec.CreateSnapshotRequest{
			SourceVolumeId: handle, Name: csiSnapshotName(vs), Parameters: params,
		})
		if err != nil {
			err = fmt.Errorf("create snapshot of volume %s: %w", handle, err)
			_ = s.contentError(ctx, content, err)
			return s.snapshotError(ctx, vs, reasonFailed, err)
		}
		if content, err = s.writeContentStatus(ctx, content, resp.GetSnapshot()); err != nil {
			return err
		}
		s.recorder.Eventf(vs, corev1.EventTypeNormal, reasonCreated, "Snapshot %s/%s was successfully created by the CSI driver.", vs.Namespace, vs.Name)
		log.Info("snapshot taken", "claim", claim, "volumeID", handle, "snapshotID", resp.GetSnapshot().GetSnapshotId(),
			"bytes", resp.GetSnapshot().GetSizeBytes())
	}
	return s.writeSnapshotStatus(ctx, vs, content)
}

// class is the named VolumeSnapshotClass, or the default one of the
// hostpath driver when name is nil.
func (s *Snapshotter) class(name *string) (*snapshotv1.VolumeSnapshotClass, error) {
	if name != nil && *name != "" {
		obj, exists, err := s.classes.GetIndexer().GetByKey(*name)
		if err != nil {
			return nil, err
		}
		if !exists {
			return nil, fmt.Errorf("volumesnapshotclass %q not found", *name)
		}
		return obj.(*snapshotv1.VolumeSnapshotClass), nil
	}
	var found []*snapshotv1.VolumeSnapshotClass
	for _, obj := range s.classes.GetIndexer().List() {
		c := obj.(*snapshotv1.VolumeSnapshotClass)
		if c.Driver == hostpath.DriverName && c.Annotations[snapshotv1.AnnIsDefaultClass] == "true" {
			found = append(found, c)
		}
	}
	switch len(found) {
	case 0:
		return nil, fmt.Errorf("no default volumesnapshotclass for driver %s and none named", hostpath.DriverName)
	case 1:
		return found[0], nil
	}
	return nil, fmt.Errorf("%d default volumesnapshotclasses for driver %s", len(found), hostpath.DriverName)
}

// ensureContent returns the dynamic content of vs, creating it if needed.
func (s *Snapshotter) ensureContent(ctx context.Context, vs *snapshotv1.VolumeSnapshot, class *snapshotv1.VolumeSnapshotClass,
	handle string, mode *corev1.PersistentVolumeMode) (*snapshotv1.VolumeSnapshotContent, error) {
	name := ContentName(vs)
	if c, err := s.cachedContent(name); err != nil || c != nil {
		return c, err
	}
	policy := class.DeletionPolicy
	if policy == "" {
		policy = snapshotv1.VolumeSnapshotContentDelete
	}
	className := class.Name
	want := &snapshotv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{ContentFinalizer},
			Annotations: map[string]string{snapshotv1.AnnNode: s.cfg.NodeName}},
		Spec: snapshotv1.VolumeSnapshotContentSpec{
			VolumeSnapshotRef: corev1.ObjectReference{Kind: "VolumeSnapshot", APIVersion: snapshotv1.SchemeGroupVersion.String(),
				Namespace: vs.Namespace, Name: vs.Name, UID: vs.UID},
			DeletionPolicy: policy, Driver: hostpath.DriverName, VolumeSnapshotClassName: &className,
			Source: snapshotv1.VolumeSnapshotContentSource{VolumeHandle: &handle}, SourceVolumeMode: mode,
		},
	}
	c, err := s.cfg.Snapshots.Contents.Create(ctx, want)
	if apierrors.IsAlreadyExists(err) {
		return s.cfg.Snapshots.Contents.Get(ctx, "", name)
	}
	return c, err
}

// bindPreProvisioned binds vs to the existing content name when this node
// holds its snapshot.
func (s *Snapshotter) bindPreProvisioned(ctx context.Context, vs *snapshotv1.VolumeSnapshot, name string) error {
	content, err := s.cachedContent(name)
	if err != nil {
		return err
	}
	if content == nil {
		return s.snapshotError(ctx, vs, reasonBindFailed, fmt.Errorf("volumesnapshotcontent %s not found", name))
	}
	if content.Spec.Driver != hostpath.DriverName {
		return nil
	}
	ref := content.Spec.VolumeSnapshotRef
	if ref.Name != vs.Name || ref.Namespace != vs.Namespace || (ref.UID != "" && ref.UID != vs.UID) {
		return s.snapshotError(ctx, vs, reasonBindFailed, fmt.Errorf("volumesnapshotcontent %s is bound to volumesnapshot %s/%s", name, ref.Namespace, ref.Name))
	}
	if content.Spec.Source.SnapshotHandle == nil || *content.Spec.Source.SnapshotHandle == "" {
		return s.snapshotError(ctx, vs, reasonBindFailed, fmt.Errorf("volumesnapshotcontent %s names no snapshotHandle", name))
	}
	handle := *content.Spec.Source.SnapshotHandle
	if node := content.Annotations[snapshotv1.AnnNode]; node != "" && node != s.cfg.NodeName {
		return nil
	}
	resp, err := s.cfg.Driver.GetSnapshot(ctx, &csispec.GetSnapshotRequest{SnapshotId: handle})
	switch status.Code(err) {
	case codes.OK:
	case codes.NotFound:
		return nil // another node's, or nobody's
	case codes.InvalidArgument:
		err = fmt.Errorf("volumesnapshotcontent %s: %w", name, err)
		_ = s.contentError(ctx, content, err)
		return s.snapshotError(ctx, vs, reasonBindFailed, err)
	default:
		return fmt.Errorf("get snapshot %s: %w", handle, err)
	}
	if vs, err = s.addSnapshotFinalizer(ctx, vs); err != nil {
		return err
	}
	if ref.UID == "" || content.Annotations[snapshotv1.AnnNode] == "" || !slices.Contains(content.Finalizers, ContentFinalizer) {
		content.Spec.VolumeSnapshotRef.UID = vs.UID
		if content.Annotations == nil {
			content.Annotations = map[string]string{}
		}
		content.Annotations[snapshotv1.AnnNode] = s.cfg.NodeName
		if !slices.Contains(content.Finalizers, ContentFinalizer) {
			content.Finalizers = append(content.Finalizers, ContentFinalizer)
		}
		if content, err = s.cfg.Snapshots.Contents.Update(ctx, content); err != nil {
			return fmt.Errorf("bind volumesnapshotcontent %s: %w", name, err)
		}
	}
	if content, err = s.writeContentStatus(ctx, content, resp.GetSnapshot()); err != nil {
		return err
	}
	s.log.Info("pre-provisioned snapshot bound", "namespace", vs.Namespace, "volumesnapshot", vs.Name, "content", name, "snapshotID", handle)
	return s.writeSnapshotStatus(ctx, vs, content)
}

func (s *Snapshotter) addSnapshotFinalizer(ctx context.Context, vs *snapshotv1.VolumeSnapshot) (*snapshotv1.VolumeSnapshot, error) {
	if slices.Contains(vs.Finalizers, SnapshotFinalizer) {
		return vs, nil
	}
	vs.Finalizers = append(vs.Finalizers, SnapshotFinalizer)
	out, err := s.cfg.Snapshots.Snapshots.Update(ctx, vs)
	if err != nil {
		return nil, fmt.Errorf("add finalizer to volumesnapshot %s/%s: %w", vs.Namespace, vs.Name, err)
	}
	return out, nil
}

// writeContentStatus records what the driver said about the snapshot.
func (s *Snapshotter) writeContentStatus(ctx context.Context, c *snapshotv1.VolumeSnapshotContent, snap *csispec.Snapshot) (*snapshotv1.VolumeSnapshotContent, error) {
	handle, size, ready := snap.GetSnapshotId(), snap.GetSizeBytes(), snap.GetReadyToUse()
	created := snap.GetCreationTime().AsTime().UnixNano()
	c.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &handle, CreationTime: &created, RestoreSize: &size, ReadyToUse: &ready}
	out, err := s.cfg.Snapshots.Contents.UpdateStatus(ctx, c)
	if err != nil {
		return nil, fmt.Errorf("update status of volumesnapshotcontent %s: %w", c.Name, err)
	}
	return out, nil
}

// writeSnapshotStatus copies the content's state into the snapshot.
func (s *Snapshotter) writeSnapshotStatus(ctx context.Context, vs *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) error {
	name := c.Name
	st := &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: &name}
	wasReady := vs.Status != nil && vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse
	if cs := c.Status; cs != nil {
		st.ReadyToUse = cs.ReadyToUse
		if cs.CreationTime != nil {
			t := metav1.NewTime(time.Unix(0, *cs.CreationTime))
			st.CreationTime = &t
		}
		if cs.RestoreSize != nil {
			st.RestoreSize = resource.NewQuantity(*cs.RestoreSize, resource.BinarySI)
		}
		st.Error = cs.Error
	}
	if vs.Status != nil && sameStatus(vs.Status, st) {
		return nil
	}
	vs.Status = st
	if _, err := s.cfg.Snapshots.Snapshots.UpdateStatus(ctx, vs); err != nil {
		return fmt.Errorf("update status of volumesnapshot %s/%s: %w", vs.Namespace, vs.Name, err)
	}
	if st.ReadyToUse != nil && *st.ReadyToUse && !wasReady {
		s.recorder.Eventf(vs, corev1.EventTypeNormal, reasonReady, "Snapshot %s/%s is ready to use.", vs.Namespace, vs.Name)
	}
	return nil
}

func sameStatus(a, b *snapshotv1.VolumeSnapshotStatus) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

// snapshotError records err on vs (status.error, an event) and retries.
func (s *Snapshotter) snapshotError(ctx context.Context, vs *snapshotv1.VolumeSnapshot, reason string, err error) error {
	msg := err.Error()
	prev := ""
	if vs.Status != nil && vs.Status.Error != nil && vs.Status.Error.Message != nil {
		prev = *vs.Status.Error.Message
	}
	if prev != msg {
		now := metav1.Now()
		if vs.Status == nil {
			vs.Status = &snapshotv1.VolumeSnapshotStatus{}
		}
		ready := false
		vs.Status.ReadyToUse = &ready
		vs.Status.Error = &snapshotv1.VolumeSnapshotError{Time: &now, Message: &msg}
		if _, uerr := s.cfg.Snapshots.Snapshots.UpdateStatus(ctx, vs); uerr != nil && !apierrors.IsNotFound(uerr) {
			return fmt.Errorf("record error %q on volumesnapshot %s/%s: %w", msg, vs.Namespace, vs.Name, uerr)
		}
		s.recorder.Event(vs, corev1.EventTypeWarning, reason, msg)
	}
	return &recordedError{fmt.Errorf("volumesnapshot %s/%s: %w", vs.Namespace, vs.Name, err)}
}

func (s *Snapshotter) contentError(ctx context.Context, c *snapshotv1.VolumeSnapshotContent, err error) error {
	msg := err.Error()
	now := metav1.Now()
	if c.Status == nil {
		c.Status = &snapshotv1.VolumeSnapshotContentStatus{}
	}
	c.Status.Error = &snapshotv1.VolumeSnapshotError{Time: &now, Message: &msg}
	_, uerr := s.cfg.Snapshots.Contents.UpdateStatus(ctx, c)
	return uerr
}

// releaseSnapshot handles a VolumeSnapshot being deleted: its content goes
// (deletionPolicy Delete) or is released (Retain), then the finalizer.
func (s *Snapshotter) releaseSnapshot(ctx context.Context, vs *snapshotv1.VolumeSnapshot) error {
	if !slices.Contains(vs.Finalizers, SnapshotFinalizer) {
		return nil
	}
	name := ""
	if vs.Status != nil && vs.Status.BoundVolumeSnapshotContentName != nil {
		name = *vs.Status.BoundVolumeSnapshotContentName
	} else if vs.Spec.Source.VolumeSnapshotContentName != nil {
		name = *vs.Spec.Source.VolumeSnapshotContentName
	} else {
		name = ContentName(vs)
	}
	content, err := s.cfg.Snapshots.Contents.Get(ctx, "", name)
	switch {
	case apierrors.IsNotFound(err):
		content = nil
	case err != nil:
		return err
	}
	if content != nil {
		if node := content.Annotations[snapshotv1.AnnNode]; node != s.cfg.NodeName {
			return nil // its node releases it
		}
		if content.Spec.VolumeSnapshotRef.UID == vs.UID || content.Spec.VolumeSnapshotRef.UID == "" {
			if content.Spec.DeletionPolicy == snapshotv1.VolumeSnapshotContentDelete {
				if content.DeletionTimestamp == nil {
					if err := s.cfg.Snapshots.Contents.Delete(ctx, "", name); err != nil && !apierrors.IsNotFound(err) {
						return fmt.Errorf("delete volumesnapshotcontent %s: %w", name, err)
					}
				}
			} else if err := s.removeContentFinalizer(ctx, content); err != nil {
				return err
			}
		}
	}
	vs.Finalizers = slices.DeleteFunc(vs.Finalizers, func(f string) bool { return f == SnapshotFinalizer })
	if _, err := s.cfg.Snapshots.Snapshots.Update(ctx, vs); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("remove finalizer of volumesnapshot %s/%s: %w", vs.Namespace, vs.Name, err)
	}
	s.log.Info("volumesnapshot released", "namespace", vs.Namespace, "volumesnapshot", vs.Name, "content", name)
	return nil
}

func (s *Snapshotter) removeContentFinalizer(ctx context.Context, c *snapshotv1.VolumeSnapshotContent) error {
	if !slices.Contains(c.Finalizers, ContentFinalizer) {
		return nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"resourceVersion": c.ResourceVersion,
		"finalizers":      slices.DeleteFunc(slices.Clone(c.Finalizers), func(f string) bool { return f == ContentFinalizer }),
	}})
	_, err := s.cfg.Snapshots.Contents.Patch(ctx, "", c.Name, types.MergePatchType, patch)
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("remove finalizer of volumesnapshotcontent %s: %w", c.Name, err)
	}
	return nil
}

// syncContent deletes the CSI snapshot of a content of this node that is
// being deleted with deletionPolicy Delete, then lets the content go.
func (s *Snapshotter) syncContent(ctx context.Context, name string) error {
	c, err := s.cachedContent(name)
	if err != nil || c == nil {
		return err
	}
	if c.DeletionTimestamp == nil || !slices.Contains(c.Finalizers, ContentFinalizer) || c.Annotations[snapshotv1.AnnNode] != s.cfg.NodeName {
		return nil
	}
	ref := c.Spec.VolumeSnapshotRef
	if key := ref.Namespace + "/" + ref.Name; ref.Name != "" {
		if vs, err := s.cachedSnapshot(key); err == nil && vs != nil && vs.DeletionTimestamp == nil && vs.UID == ref.UID {
			return nil // still bound to a live snapshot: kept until it goes
		}
	}
	handle := ""
	if c.Status != nil && c.Status.SnapshotHandle != nil {
		handle = *c.Status.SnapshotHandle
	} else if c.Spec.Source.SnapshotHandle != nil {
		handle = *c.Spec.Source.SnapshotHandle
	}
	if c.Spec.DeletionPolicy == snapshotv1.VolumeSnapshotContentDelete && handle != "" {
		if _, err := s.cfg.Driver.DeleteSnapshot(ctx, &csispec.DeleteSnapshotRequest{SnapshotId: handle}); err != nil {
			err = fmt.Errorf("delete snapshot %s: %w", handle, err)
			_ = s.contentError(ctx, c, err)
			s.recorder.Event(c, corev1.EventTypeWarning, reasonDeleteFailed, err.Error())
			return err
		}
		s.recorder.Eventf(c, corev1.EventTypeNormal, reasonDeleted, "deleted snapshot %s", handle)
		s.log.Info("snapshot deleted", "content", name, "snapshotID", handle)
	}
	return s.removeContentFinalizer(ctx, c)
}
