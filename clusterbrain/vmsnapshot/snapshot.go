package vmsnapshot

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	volsnapv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
)

// waitRetry is how soon a snapshot or restore waiting on something no
// informer of ours reports (a claim, a lock) is looked at again.
const waitRetry = 3 * time.Second

// ContentName is the VirtualMachineSnapshotContent of a snapshot.
func ContentName(s *snapv1beta1.VirtualMachineSnapshot) string {
	return "vmsnapshot-content-" + string(s.UID)
}

// VolumeSnapshotName is the CSI VolumeSnapshot of one volume of a
// snapshot.
func VolumeSnapshotName(s *snapv1beta1.VirtualMachineSnapshot, volume string) string {
	return fmt.Sprintf("vmsnapshot-%s-volume-%s", s.UID, volume)
}

func (c *Controller) syncSnapshot(ctx context.Context, key string) (time.Duration, error) {
	cached, ok, err := get[*snapv1beta1.VirtualMachineSnapshot](c.snapshots, key)
	if err != nil || !ok {
		return 0, err
	}
	s := cached.DeepCopy()
	if s.DeletionTimestamp != nil {
		return 0, c.deleteSnapshot(ctx, s)
	}
	if !hasFinalizer(s.Finalizers, SnapshotFinalizer) {
		s.Finalizers = append(s.Finalizers, SnapshotFinalizer)
		_, err := c.cfg.Virt.VMSnapshots.Update(ctx, s)
		return 0, err
	}
	if s.Status == nil || (s.Status.Phase != snapv1beta1.Succeeded && s.Status.Phase != snapv1beta1.Failed) {
		// The cache may lag behind this controller's last status write:
		// work from the stored object.
		fresh, err := c.cfg.Virt.VMSnapshots.Get(ctx, s.Namespace, s.Name)
		if apierrors.IsNotFound(err) {
			return 0, nil
		}
		if err != nil {
			return 0, err
		}
		s = fresh
	}
	if s.Status == nil {
		s.Status = &snapv1beta1.VirtualMachineSnapshotStatus{}
	}
	orig := s.Status.DeepCopy()
	after, err := c.progressSnapshot(ctx, s)
	if !equality.Semantic.DeepEqual(orig, s.Status) {
		if _, uerr := c.cfg.Virt.VMSnapshots.UpdateStatus(ctx, s); uerr != nil {
			return 0, errors.Join(err, fmt.Errorf("update status: %w", uerr))
		}
	}
	return after, err
}

// progressSnapshot moves s one step on and records it on s.Status.
func (c *Controller) progressSnapshot(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot) (time.Duration, error) {
	st := s.Status
	if st.Phase == snapv1beta1.Succeeded || st.Phase == snapv1beta1.Failed {
		// A sync on a stale cache may have locked the source again.
		return 0, c.unlockVM(ctx, s.Namespace, s.Spec.Source.Name, "snapshotInProgress", s.Name)
	}
	src := s.Spec.Source
	if src.Kind != "VirtualMachine" || (src.APIGroup != nil && *src.APIGroup != kubevirtv1.GroupVersion.Group) {
		c.failSnapshot(ctx, s, fmt.Sprintf("source kind %s is not supported: only VirtualMachine", src.Kind))
		return 0, nil
	}
	if st.Phase == snapv1beta1.PhaseUnset {
		st.Phase = snapv1beta1.InProgress
		st.Conditions = setConditions(st.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, "Source not locked"),
			c.condition(snapv1beta1.ConditionReady, false, "Not ready"))
	}
	deadline := snapv1beta1.DefaultFailureDeadline
	if d := s.Spec.FailureDeadline; d != nil {
		deadline = d.Duration
	}
	if left := s.CreationTimestamp.Add(deadline).Sub(c.cfg.Now()); deadline > 0 && left <= 0 {
		c.failSnapshot(ctx, s, fmt.Sprintf("snapshot did not complete within the failure deadline %s", deadline))
		return 0, nil
	}
	content, ok, err := get[*snapv1beta1.VirtualMachineSnapshotContent](c.contents, s.Namespace+"/"+ContentName(s))
	if err != nil {
		return 0, err
	}
	if !ok {
		return c.startSnapshot(ctx, s)
	}
	return c.takeVolumeSnapshots(ctx, s, content.DeepCopy())
}

// startSnapshot locks the VM, freezes its guest when it can and writes
// the content.
func (c *Controller) startSnapshot(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot) (time.Duration, error) {
	st := s.Status
	vm, err := c.vm(s.Namespace, s.Spec.Source.Name)
	if err != nil {
		return 0, err
	}
	if vm == nil {
		st.Conditions = setConditions(st.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, "Source does not exist"))
		return waitRetry, nil
	}
	locked, err := c.lockVM(ctx, vm, "snapshotInProgress", s.Name)
	if err != nil {
		return 0, err
	}
	if !locked {
		st.Conditions = setConditions(st.Conditions, c.condition(snapv1beta1.ConditionProgressing, false,
			"Source not locked: "+busyWith(vm)))
		return waitRetry, nil
	}
	st.SourceUID = &vm.UID
	content, waiting, err := c.buildContent(ctx, s, vm)
	if err != nil {
		return 0, err
	}
	if waiting != "" {
		st.Conditions = setConditions(st.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, waiting))
		return waitRetry, nil
	}
	vmi, err := c.vmi(vm.Namespace, vm.Name)
	if err != nil {
		return 0, err
	}
	st.Indications = nil
	if online(vmi) {
		st.Indications = append(st.Indications, snapv1beta1.VMSnapshotOnlineSnapshotIndication)
		if agentConnected(vmi) && c.cfg.Freezer != nil {
			st.Indications = append(st.Indications, snapv1beta1.VMSnapshotGuestAgentIndication)
		} else {
			st.Indications = append(st.Indications, snapv1beta1.VMSnapshotNoGuestAgentIndication)
		}
		if condTrue(vmi.Status.Conditions, kubevirtv1.VirtualMachineInstancePaused) {
			st.Indications = append(st.Indications, snapv1beta1.VMSnapshotPausedIndication)
		}
	}
	st.SnapshotVolumes = &snapv1beta1.SnapshotVolumesLists{}
	for _, b := range content.Spec.VolumeBackups {
		if b.VolumeSnapshotName != nil {
			st.SnapshotVolumes.IncludedVolumes = append(st.SnapshotVolumes.IncludedVolumes, b.VolumeName)
		} else {
			st.SnapshotVolumes.ExcludedVolumes = append(st.SnapshotVolumes.ExcludedVolumes, b.VolumeName)
		}
	}
	if len(st.SnapshotVolumes.ExcludedVolumes) > 0 {
		st.Indications = append(st.Indications, snapv1beta1.VMSnapshotPartialSnapshotIndication)
	}
	if _, err := c.cfg.Virt.VMSnapshotContents.Create(ctx, content); err != nil && !apierrors.IsAlreadyExists(err) {
		return 0, fmt.Errorf("create content: %w", err)
	}
	name := content.Name
	st.VirtualMachineSnapshotContentName = &name
	st.Conditions = setConditions(st.Conditions, c.condition(snapv1beta1.ConditionProgressing, true, "Source locked and operation in progress"))
	return 0, nil
}

// buildContent is the content of s: the VM as it is and one backup per
// claim-backed volume. waiting says why it cannot be built yet.
func (c *Controller) buildContent(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot, vm *kubevirtv1.VirtualMachine) (*snapv1beta1.VirtualMachineSnapshotContent, string, error) {
	snapName := s.Name
	content := &snapv1beta1.VirtualMachineSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: ContentName(s), Finalizers: nil},
		Spec: snapv1beta1.VirtualMachineSnapshotContentSpec{VirtualMachineSnapshotName: &snapName,
			Source: snapv1beta1.SourceSpec{VirtualMachine: &snapv1beta1.VirtualMachine{
				ObjectMeta: metav1.ObjectMeta{Name: vm.Name, Namespace: vm.Namespace, UID: vm.UID, Generation: vm.Generation,
					Labels: vm.Labels, Annotations: vm.Annotations},
				Spec: *vm.Spec.DeepCopy(), Status: *vm.Status.DeepCopy()}}},
	}
	if s.Spec.DeletionPolicy == nil || *s.Spec.DeletionPolicy == snapv1beta1.VirtualMachineSnapshotContentDelete {
		yes := true
		content.OwnerReferences = []metav1.OwnerReference{{APIVersion: snapv1beta1.SchemeGroupVersion.String(),
			Kind: "VirtualMachineSnapshot", Name: s.Name, UID: s.UID, Controller: &yes, BlockOwnerDeletion: &yes}}
	}
	for _, v := range vm.Spec.Template.Spec.Volumes {
		claimName := ""
		switch {
		case v.PersistentVolumeClaim != nil:
			claimName = v.PersistentVolumeClaim.ClaimName
		case v.DataVolume != nil:
			claimName = v.DataVolume.Name
		default:
			continue // not a disk of its own (containerDisk, cloud-init, ...)
		}
		pvc, err := c.cfg.Kube.CoreV1().PersistentVolumeClaims(vm.Namespace).Get(ctx, claimName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil, fmt.Sprintf("Volume %s: claim %s does not exist", v.Name, claimName), nil
		}
		if err != nil {
			return nil, "", err
		}
		if pvc.Status.Phase != corev1.ClaimBound {
			return nil, fmt.Sprintf("Volume %s: claim %s is not bound", v.Name, claimName), nil
		}
		b := snapv1beta1.VolumeBackup{VolumeName: v.Name, PersistentVolumeClaim: snapv1beta1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: pvc.Name, Namespace: pvc.Namespace, Labels: pvc.Labels, Annotations: pvc.Annotations},
			Spec:       *pvc.Spec.DeepCopy()}}
		class, err := c.snapshotClass(ctx, pvc)
		if err != nil {
			return nil, "", err
		}
		if class != "" {
			n := VolumeSnapshotName(s, v.Name)
			b.VolumeSnapshotName = &n
		}
		content.Spec.VolumeBackups = append(content.Spec.VolumeBackups, b)
	}
	return content, "", nil
}

// snapshotClass is the VolumeSnapshotClass for pvc's driver (its default
// one first), "" when the driver has none: the volume is then not
// snapshotted.
func (c *Controller) snapshotClass(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (string, error) {
	if pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName == "" {
		return "", nil
	}
	sc, err := c.cfg.Kube.StorageV1().StorageClasses().Get(ctx, *pvc.Spec.StorageClassName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	classes, err := c.cfg.Snapshots.Classes.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		return "", fmt.Errorf("list volume snapshot classes: %w", err)
	}
	name := ""
	for _, cl := range classes {
		if cl.Driver != sc.Provisioner {
			continue
		}
		if cl.Annotations[volsnapv1.AnnIsDefaultClass] == "true" {
			return cl.Name, nil
		}
		if name == "" || cl.Name < name {
			name = cl.Name
		}
	}
	return name, nil
}

// takeVolumeSnapshots creates the content's VolumeSnapshots (the guest
// frozen meanwhile when it can be) and reports their progress.
func (c *Controller) takeVolumeSnapshots(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot, content *snapv1beta1.VirtualMachineSnapshotContent) (time.Duration, error) {
	st := s.Status
	frozen := false
	var statuses []snapv1beta1.VolumeSnapshotStatus
	allCut, allReady := true, true
	var failure string
	for _, b := range content.Spec.VolumeBackups {
		if b.VolumeSnapshotName == nil {
			continue
		}
		vs, ok, err := get[*volsnapv1.VolumeSnapshot](c.volumeSnapshots, s.Namespace+"/"+*b.VolumeSnapshotName)
		if err != nil {
			return 0, err
		}
		if !ok {
			// The cache may not show one created by the last sync yet:
			// ask before freezing again.
			switch vs, err = c.cfg.Snapshots.Snapshots.Get(ctx, s.Namespace, *b.VolumeSnapshotName); {
			case err == nil:
				ok = true
			case !apierrors.IsNotFound(err):
				return 0, err
			}
		}
		if !ok {
			if !frozen && slices.Contains(st.Indications, snapv1beta1.VMSnapshotGuestAgentIndication) {
				if err := c.freeze(ctx, s); err != nil {
					return 0, err
				}
				frozen = true
			}
			if vs, err = c.createVolumeSnapshot(ctx, s, content, b); err != nil {
				return 0, err
			}
		}
		vst := snapv1beta1.VolumeSnapshotStatus{VolumeSnapshotName: vs.Name}
		if vs.Status != nil {
			vst.CreationTime, vst.ReadyToUse = vs.Status.CreationTime, vs.Status.ReadyToUse
			if e := vs.Status.Error; e != nil && e.Message != nil {
				vst.Error = &snapv1beta1.Error{Time: e.Time, Message: e.Message}
				failure = fmt.Sprintf("volume snapshot %s: %s", vs.Name, *e.Message)
			}
		}
		if vst.CreationTime == nil {
			allCut = false
		}
		if vst.ReadyToUse == nil || !*vst.ReadyToUse {
			allReady = false
		}
		statuses = append(statuses, vst)
	}
	if allCut && slices.Contains(st.Indications, snapv1beta1.VMSnapshotGuestAgentIndication) {
		if err := c.thaw(ctx, s); err != nil {
			return 0, err
		}
	}
	cst := &snapv1beta1.VirtualMachineSnapshotContentStatus{VolumeSnapshotStatus: statuses, ReadyToUse: &allReady}
	if content.Status != nil {
		cst.CreationTime = content.Status.CreationTime
	}
	if allCut && cst.CreationTime == nil {
		now := metav1.NewTime(c.cfg.Now())
		cst.CreationTime = &now
	}
	if failure != "" {
		now := metav1.NewTime(c.cfg.Now())
		cst.Error = &snapv1beta1.Error{Time: &now, Message: &failure}
		if content.Status != nil && content.Status.Error != nil && content.Status.Error.Message != nil && *content.Status.Error.Message == failure {
			cst.Error.Time = content.Status.Error.Time
		}
	}
	if !equality.Semantic.DeepEqual(content.Status, cst) {
		content.Status = cst
		if _, err := c.cfg.Virt.VMSnapshotContents.UpdateStatus(ctx, content); err != nil {
			return 0, fmt.Errorf("update content status: %w", err)
		}
	}
	st.Error = cst.Error
	if !allReady {
		return 0, nil
	}
	st.Phase = snapv1beta1.Succeeded
	yes := true
	st.ReadyToUse, st.CreationTime, st.Error = &yes, cst.CreationTime, nil
	st.Conditions = setConditions(st.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, "Operation complete"),
		c.condition(snapv1beta1.ConditionReady, true, "Operation complete"))
	return 0, c.unlockVM(ctx, s.Namespace, s.Spec.Source.Name, "snapshotInProgress", s.Name)
}

func (c *Controller) createVolumeSnapshot(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot, content *snapv1beta1.VirtualMachineSnapshotContent, b snapv1beta1.VolumeBackup) (*volsnapv1.VolumeSnapshot, error) {
	class, err := c.snapshotClass(ctx, &corev1.PersistentVolumeClaim{Spec: b.PersistentVolumeClaim.Spec})
	if err != nil {
		return nil, err
	}
	claim := b.PersistentVolumeClaim.Name
	yes := true
	vs := &volsnapv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: *b.VolumeSnapshotName,
			Labels: map[string]string{labelSnapshot: s.Name},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: snapv1beta1.SchemeGroupVersion.String(),
				Kind: "VirtualMachineSnapshotContent", Name: content.Name, UID: content.UID, Controller: &yes, BlockOwnerDeletion: &yes}}},
		Spec: volsnapv1.VolumeSnapshotSpec{Source: volsnapv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim}},
	}
	if class != "" {
		vs.Spec.VolumeSnapshotClassName = &class
	}
	got, err := c.cfg.Snapshots.Snapshots.Create(ctx, vs)
	if apierrors.IsAlreadyExists(err) {
		return c.cfg.Snapshots.Snapshots.Get(ctx, vs.Namespace, vs.Name)
	}
	if err != nil {
		return nil, fmt.Errorf("create volume snapshot %s: %w", vs.Name, err)
	}
	c.log.Info("volume snapshot created", "vmsnapshot", s.Namespace+"/"+s.Name, "volumesnapshot", vs.Name, "claim", claim)
	return got, nil
}

// freeze freezes the source's guest; a failed freeze is thawed (the
// agent may be half way) and retried.
func (c *Controller) freeze(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot) error {
	vmi, err := c.vmi(s.Namespace, s.Spec.Source.Name)
	if err != nil || vmi == nil {
		return fmt.Errorf("freeze: vmi %s is gone: %w", s.Spec.Source.Name, err)
	}
	if err := c.cfg.Freezer.Freeze(ctx, vmi); err != nil {
		_ = c.cfg.Freezer.Unfreeze(ctx, vmi)
		return fmt.Errorf("freeze %s/%s: %w", vmi.Namespace, vmi.Name, err)
	}
	c.log.Info("guest frozen", "vmsnapshot", s.Namespace+"/"+s.Name, "vmi", vmi.Name)
	return nil
}

// thaw thaws the source's guest; a VMI that is gone needs none.
func (c *Controller) thaw(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot) error {
	if c.cfg.Freezer == nil {
		return nil
	}
	vmi, err := c.vmi(s.Namespace, s.Spec.Source.Name)
	if err != nil || !online(vmi) {
		return err
	}
	if err := c.cfg.Freezer.Unfreeze(ctx, vmi); err != nil {
		return fmt.Errorf("thaw %s/%s: %w", vmi.Namespace, vmi.Name, err)
	}
	return nil
}

// failSnapshot ends s Failed with message, thawing and unlocking the
// source.
func (c *Controller) failSnapshot(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot, message string) {
	st := s.Status
	st.Phase = snapv1beta1.Failed
	now := metav1.NewTime(c.cfg.Now())
	st.Error = &snapv1beta1.Error{Time: &now, Message: &message}
	fail := c.condition(snapv1beta1.ConditionFailure, true, "Operation failed")
	fail.Message = message
	st.Conditions = setConditions(st.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, "Operation failed"),
		c.condition(snapv1beta1.ConditionReady, false, "Operation failed"), fail)
	if slices.Contains(st.Indications, snapv1beta1.VMSnapshotGuestAgentIndication) {
		if err := c.thaw(ctx, s); err != nil {
			c.log.Warn("thaw of a failed snapshot", "vmsnapshot", s.Namespace+"/"+s.Name, "err", err)
		}
	}
	if err := c.unlockVM(ctx, s.Namespace, s.Spec.Source.Name, "snapshotInProgress", s.Name); err != nil {
		c.log.Warn("unlock of a failed snapshot's vm", "vmsnapshot", s.Namespace+"/"+s.Name, "err", err)
	}
	c.log.Info("snapshot failed", "vmsnapshot", s.Namespace+"/"+s.Name, "reason", message)
}

// deleteSnapshot deals with the content per the deletion policy, unlocks
// the VM and releases s.
func (c *Controller) deleteSnapshot(ctx context.Context, s *snapv1beta1.VirtualMachineSnapshot) error {
	if !hasFinalizer(s.Finalizers, SnapshotFinalizer) {
		return nil
	}
	if s.Status != nil && s.Status.Phase == snapv1beta1.InProgress && slices.Contains(s.Status.Indications, snapv1beta1.VMSnapshotGuestAgentIndication) {
		if err := c.thaw(ctx, s); err != nil {
			return err
		}
	}
	if err := c.unlockVM(ctx, s.Namespace, s.Spec.Source.Name, "snapshotInProgress", s.Name); err != nil {
		return err
	}
	if s.Spec.DeletionPolicy == nil || *s.Spec.DeletionPolicy == snapv1beta1.VirtualMachineSnapshotContentDelete {
		content, err := c.cfg.Virt.VMSnapshotContents.Get(ctx, s.Namespace, ContentName(s))
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return err
		default:
			for _, b := range content.Spec.VolumeBackups {
				if b.VolumeSnapshotName == nil {
					continue
				}
				if err := c.cfg.Snapshots.Snapshots.Delete(ctx, s.Namespace, *b.VolumeSnapshotName); err != nil && !apierrors.IsNotFound(err) {
					return fmt.Errorf("delete volume snapshot %s: %w", *b.VolumeSnapshotName, err)
				}
			}
			if err := c.cfg.Virt.VMSnapshotContents.Delete(ctx, s.Namespace, content.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete content: %w", err)
			}
		}
	}
	s.Finalizers = removeFinalizer(s.Finalizers, SnapshotFinalizer)
	_, err := c.cfg.Virt.VMSnapshots.Update(ctx, s)
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

func online(vmi *kubevirtv1.VirtualMachineInstance) bool {
	return vmi != nil && vmi.DeletionTimestamp == nil && !vmi.IsFinal() && vmi.Status.Phase != ""
}

func agentConnected(vmi *kubevirtv1.VirtualMachineInstance) bool {
	return condTrue(vmi.Status.Conditions, kubevirtv1.VirtualMachineInstanceAgentConnected)
}

func condTrue(conds []kubevirtv1.VirtualMachineInstanceCondition, t kubevirtv1.VirtualMachineInstanceConditionType) bool {
	for _, c := range conds {
		if c.Type == t {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
