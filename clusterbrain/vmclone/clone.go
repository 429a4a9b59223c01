// Package vmclone is KubeVirt's clone controller: a VirtualMachineClone
// copies a VM, or the VM kept in a VirtualMachineSnapshot, to a new VM.
// It works as KubeVirt's does, through the snapshot kinds: a VM source is
// snapshotted (tmp-snapshot-<clone UID>), the snapshot restored to the
// target name (tmp-restore-<clone UID>) with patches that filter the
// labels and annotations (of the VM and of its template), give the
// interfaces the requested MAC addresses or none (the MAC pool then
// allocates new ones), and give the firmware the requested SMBIOS serial
// or a new one (and no fixed UUID); the temporary snapshot and restore are
// deleted once the target exists and its claims are restored.
//
// Phases, as KubeVirt: SnapshotInProgress, CreatingTargetVM,
// RestoreInProgress, Succeeded or Failed; conditions Progressing and Ready.
package vmclone

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// Config configures the controller.
type Config struct {
	Virt *client.Set
	Log  *slog.Logger
	// Now defaults to time.Now.
	Now func() time.Time
}

// Controller runs the clone queue.
type Controller struct {
	cfg                         Config
	clones, snapshots, restores cache.SharedIndexInformer
	contents                    cache.SharedIndexInformer
	queue                       *controller.Queue
}

// New validates cfg and wires the informers.
func New(cfg Config) (*Controller, error) {
	if cfg.Virt == nil {
		return nil, errors.New("vmclone: the client set is required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	c := &Controller{cfg: cfg,
		clones:    cfg.Virt.VMClones.Informer("", 0, nil),
		snapshots: cfg.Virt.VMSnapshots.Informer("", 0, nil),
		restores:  cfg.Virt.VMRestores.Informer("", 0, nil),
		contents:  cfg.Virt.VMSnapshotContents.Informer("", 0, nil)}
	var err error
	if c.queue, err = controller.New(controller.Config{Name: "vm-clones", Sync: c.sync, Backoff: controller.BackoffAPI,
		Log: cfg.Log, KeyAttr: "vmclone", Quiet: apierrors.IsConflict}); err != nil {
		return nil, err
	}
	owner := func(obj any) {
		if key, ok := controller.OwnerKey(obj, clonev1beta1.VirtualMachineCloneKind.Kind); ok {
			c.queue.Add(key)
		}
	}
	for _, reg := range []struct {
		inf cache.SharedIndexInformer
		h   cache.ResourceEventHandler
	}{
		{c.clones, controller.OnAddOrUpdate(c.queue.Enqueue)},
		{c.snapshots, controller.OnAddOrUpdate(owner)},
		{c.restores, controller.OnAddOrUpdate(owner)},
	} {
		if _, err := reg.inf.AddEventHandler(reg.h); err != nil {
			return nil, fmt.Errorf("vmclone: register handler: %w", err)
		}
	}
	return c, nil
}

// Name implements the brain's Role.
func (c *Controller) Name() string { return "vm-clones" }

// Run runs the informers and the queue until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	infs := []cache.SharedIndexInformer{c.clones, c.snapshots, c.restores, c.contents}
	var synced []cache.InformerSynced
	for _, inf := range infs {
		go inf.RunWithContext(ctx)
		synced = append(synced, inf.HasSynced)
	}
	return c.queue.Run(ctx, synced...)
}

// waitRetry is how soon a clone waiting on what no informer here reports
// (the target VM) is looked at again.
const waitRetry = 2 * time.Second

func tmpSnapshotName(vc *clonev1beta1.VirtualMachineClone) string {
	return "tmp-snapshot-" + string(vc.UID)
}
func tmpRestoreName(vc *clonev1beta1.VirtualMachineClone) string {
	return "tmp-restore-" + string(vc.UID)
}

// TargetName is the clone's target VM: spec.target, else a name made from
// the source and the clone's UID.
func TargetName(vc *clonev1beta1.VirtualMachineClone) string {
	if vc.Spec.Target != nil && vc.Spec.Target.Name != "" {
		return vc.Spec.Target.Name
	}
	if vc.Status.TargetName != nil {
		return *vc.Status.TargetName
	}
	uid := string(vc.UID)
	if len(uid) > 5 {
		uid = uid[:5]
	}
	return fmt.Sprintf("clone-%s-%s", vc.Spec.Source.Name, uid)
}

func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	o, ok, err := c.clones.GetStore().GetByKey(key)
	if err != nil || !ok {
		return 0, err
	}
	vc := o.(*clonev1beta1.VirtualMachineClone)
	if vc.DeletionTimestamp != nil || vc.Status.Phase == clonev1beta1.Succeeded || vc.Status.Phase == clonev1beta1.Failed {
		return 0, nil
	}
	// A snapshot's or restore's event can come before this controller's
	// last status write reaches the cache: work from the stored clone, so
	// a step is never redone on a stale phase (nor fails on a conflict).
	vc, err = c.cfg.Virt.VMClones.Get(ctx, vc.Namespace, vc.Name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if vc.DeletionTimestamp != nil || vc.Status.Phase == clonev1beta1.Succeeded || vc.Status.Phase == clonev1beta1.Failed {
		return 0, nil
	}
	orig := vc.Status.DeepCopy()
	after, err := c.progress(ctx, vc)
	if !equality.Semantic.DeepEqual(orig, &vc.Status) {
		if _, uerr := c.cfg.Virt.VMClones.UpdateStatus(ctx, vc); uerr != nil {
			return 0, errors.Join(err, fmt.Errorf("update status: %w", uerr))
		}
	}
	return after, err
}

func (c *Controller) progress(ctx context.Context, vc *clonev1beta1.VirtualMachineClone) (time.Duration, error) {
	st := &vc.Status
	if st.Phase == clonev1beta1.PhaseUnset {
		now := metav1.NewTime(c.cfg.Now())
		st.CreationTime = &now
		target := TargetName(vc)
		st.TargetName = &target
		c.setConditions(vc, true, false, "Started")
	}
	src := vc.Spec.Source
	if src == nil {
		return c.fail(vc, "spec.source is required")
	}
	if t := vc.Spec.Target; t != nil && t.Kind != "" && t.Kind != "VirtualMachine" {
		return c.fail(vc, fmt.Sprintf("target kind %s is not supported: only VirtualMachine", t.Kind))
	}
	switch st.Phase {
	case clonev1beta1.PhaseUnset:
		switch src.Kind {
		case "VirtualMachine":
			return c.snapshotSource(ctx, vc)
		case "VirtualMachineSnapshot":
			name := src.Name
			st.SnapshotName = &name
			st.Phase = clonev1beta1.SnapshotInProgress
			return 0, nil
		default:
			return c.fail(vc, fmt.Sprintf("source kind %s is not supported: only VirtualMachine and VirtualMachineSnapshot", src.Kind))
		}
	case clonev1beta1.SnapshotInProgress:
		return c.awaitSnapshot(ctx, vc)
	case clonev1beta1.CreatingTargetVM:
		return c.awaitTarget(ctx, vc)
	case clonev1beta1.RestoreInProgress:
		return c.awaitRestore(ctx, vc)
	}
	return 0, nil
}

// snapshotSource takes the temporary snapshot of a source VM.
func (c *Controller) snapshotSource(ctx context.Context, vc *clonev1beta1.VirtualMachineClone) (time.Duration, error) {
	if _, err := c.cfg.Virt.VMs.Get(ctx, vc.Namespace, vc.Spec.Source.Name); apierrors.IsNotFound(err) {
		c.setConditions(vc, false, false, fmt.Sprintf("Source VM %s does not exist", vc.Spec.Source.Name))
		return waitRetry, nil
	} else if err != nil {
		return 0, err
	}
	if err := c.targetFree(ctx, vc); err != nil {
		return c.fail(vc, err.Error())
	}
	group := kubevirtv1.GroupVersion.Group
	snap := &snapv1beta1.VirtualMachineSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: vc.Namespace, Name: tmpSnapshotName(vc), OwnerReferences: ownedBy(vc)},
		Spec: snapv1beta1.VirtualMachineSnapshotSpec{Source: corev1.TypedLocalObjectReference{APIGroup: &group,
			Kind: "VirtualMachine", Name: vc.Spec.Source.Name}},
	}
	if _, err := c.cfg.Virt.VMSnapshots.Create(ctx, snap); err != nil && !apierrors.IsAlreadyExists(err) {
		return 0, fmt.Errorf("create snapshot: %w", err)
	}
	name := snap.Name
	vc.Status.SnapshotName = &name
	vc.Status.Phase = clonev1beta1.SnapshotInProgress
	c.setConditions(vc, true, false, "Snapshot in progress")
	return 0, nil
}

// targetFree fails when the target VM exists and is not this clone's.
func (c *Controller) targetFree(ctx context.Context, vc *clonev1beta1.VirtualMachineClone) error {
	vm, err := c.cfg.Virt.VMs.Get(ctx, vc.Namespace, TargetName(vc))
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if strings.HasPrefix(vm.Annotations["restore.kubevirt.io/lastRestoreUID"], tmpRestoreName(vc)+"-") {
		return nil
	}
	return fmt.Errorf("target VM %s already exists", vm.Name)
}

// awaitSnapshot waits for the snapshot, then starts the restore to the
// target with the clone's patches.
func (c *Controller) awaitSnapshot(ctx context.Context, vc *clonev1beta1.VirtualMachineClone) (time.Duration, error) {
	o, ok, err := c.snapshots.GetStore().GetByKey(vc.Namespace + "/" + *vc.Status.SnapshotName)
	if err != nil {
		return 0, err
	}
	if !ok {
		if vc.Spec.Source.Kind == "VirtualMachineSnapshot" {
			return c.fail(vc, fmt.Sprintf("source snapshot %s does not exist", *vc.Status.SnapshotName))
		}
		return waitRetry, nil // just created: the cache does not show it yet
	}
	snap := o.(*snapv1beta1.VirtualMachineSnapshot)
	if snap.Status != nil && snap.Status.Phase == snapv1beta1.Failed {
		return c.fail(vc, fmt.Sprintf("snapshot %s failed", snap.Name))
	}
	if snap.Status == nil || snap.Status.ReadyToUse == nil || !*snap.Status.ReadyToUse || snap.Status.VirtualMachineSnapshotContentName == nil {
		return 0, nil
	}
	co, ok, err := c.contents.GetStore().GetByKey(vc.Namespace + "/" + *snap.Status.VirtualMachineSnapshotContentName)
	if err != nil || !ok {
		return waitRetry, err
	}
	content := co.(*snapv1beta1.VirtualMachineSnapshotContent)
	if content.Spec.Source.VirtualMachine == nil {
		return c.fail(vc, fmt.Sprintf("snapshot %s holds no VM", snap.Name))
	}
	if err := c.targetFree(ctx, vc); err != nil {
		return c.fail(vc, err.Error())
	}
	patches, err := Patches(vc, content.Spec.Source.VirtualMachine)
	if err != nil {
		return c.fail(vc, err.Error())
	}
	policy := clonev1beta1.VolumeNamePolicyRandomizeNames
	if vc.Spec.VolumeNamePolicy != nil {
		policy = *vc.Spec.VolumeNamePolicy
	}
	volumePolicy := policy.ToVolumeRestorePolicy()
	group := kubevirtv1.GroupVersion.Group
	restore := &snapv1beta1.VirtualMachineRestore{
		ObjectMeta: metav1.ObjectMeta{Namespace: vc.Namespace, Name: tmpRestoreName(vc), OwnerReferences: ownedBy(vc)},
		Spec: snapv1beta1.VirtualMachineRestoreSpec{
			Target:                     corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachine", Name: TargetName(vc)},
			VirtualMachineSnapshotName: snap.Name, VolumeRestorePolicy: &volumePolicy, Patches: patches},
	}
	if _, err := c.cfg.Virt.VMRestores.Create(ctx, restore); err != nil && !apierrors.IsAlreadyExists(err) {
		return 0, fmt.Errorf("create restore: %w", err)
	}
	name := restore.Name
	vc.Status.RestoreName = &name
	vc.Status.Phase = clonev1beta1.CreatingTargetVM
	c.setConditions(vc, true, false, "Creating target VM")
	return waitRetry, nil
}

// awaitTarget waits for the restore to create the target VM.
func (c *Controller) awaitTarget(ctx context.Context, vc *clonev1beta1.VirtualMachineClone) (time.Duration, error) {
	if failed, msg := c.restoreFailed(vc); failed {
		return c.fail(vc, msg)
	}
	if _, err := c.cfg.Virt.VMs.Get(ctx, vc.Namespace, TargetName(vc)); apierrors.IsNotFound(err) {
		return waitRetry, nil
	} else if err != nil {
		return 0, err
	}
	vc.Status.Phase = clonev1beta1.RestoreInProgress
	c.setConditions(vc, true, false, "Restore in progress")
	return c.awaitRestore(ctx, vc)
}

// awaitRestore waits for the restore to complete, then removes the
// temporary objects.
func (c *Controller) awaitRestore(ctx context.Context, vc *clonev1beta1.VirtualMachineClone) (time.Duration, error) {
	if failed, msg := c.restoreFailed(vc); failed {
		return c.fail(vc, msg)
	}
	o, ok, err := c.restores.GetStore().GetByKey(vc.Namespace + "/" + *vc.Status.RestoreName)
	if err != nil || !ok {
		return waitRetry, err
	}
	r := o.(*snapv1beta1.VirtualMachineRestore)
	if r.Status == nil || r.Status.Complete == nil || !*r.Status.Complete {
		return 0, nil
	}
	if err := c.cleanup(ctx, vc); err != nil {
		return 0, err
	}
	vc.Status.Phase = clonev1beta1.Succeeded
	c.setConditions(vc, false, true, "Succeeded")
	c.cfg.Log.Info("clone done", "vmclone", vc.Namespace+"/"+vc.Name, "target", TargetName(vc))
	return 0, nil
}

func (c *Controller) restoreFailed(vc *clonev1beta1.VirtualMachineClone) (bool, string) {
	if vc.Status.RestoreName == nil {
		return false, ""
	}
	o, ok, _ := c.restores.GetStore().GetByKey(vc.Namespace + "/" + *vc.Status.RestoreName)
	if !ok {
		return false, ""
	}
	r := o.(*snapv1beta1.VirtualMachineRestore)
	if r.Status == nil {
		return false, ""
	}
	for _, cnd := range r.Status.Conditions {
		if cnd.Type == snapv1beta1.ConditionFailure && cnd.Status == corev1.ConditionTrue {
			return true, fmt.Sprintf("restore %s failed: %s", r.Name, cnd.Message)
		}
	}
	return false, ""
}

// cleanup deletes the temporary restore and (for a VM source) snapshot: a
// complete restore's claims are provisioned and no longer need it.
func (c *Controller) cleanup(ctx context.Context, vc *clonev1beta1.VirtualMachineClone) error {
	if err := c.cfg.Virt.VMRestores.Delete(ctx, vc.Namespace, tmpRestoreName(vc), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete restore: %w", err)
	}
	if vc.Spec.Source.Kind != "VirtualMachine" {
		return nil
	}
	if err := c.cfg.Virt.VMSnapshots.Delete(ctx, vc.Namespace, tmpSnapshotName(vc), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete snapshot: %w", err)
	}
	return nil
}

func (c *Controller) fail(vc *clonev1beta1.VirtualMachineClone, message string) (time.Duration, error) {
	vc.Status.Phase = clonev1beta1.Failed
	c.setConditions(vc, false, false, message)
	c.cfg.Log.Info("clone failed", "vmclone", vc.Namespace+"/"+vc.Name, "reason", message)
	return 0, nil
}

// setConditions sets Progressing and Ready with reason.
func (c *Controller) setConditions(vc *clonev1beta1.VirtualMachineClone, progressing, ready bool, reason string) {
	now := metav1.NewTime(c.cfg.Now())
	status := func(b bool) corev1.ConditionStatus {
		if b {
			return corev1.ConditionTrue
		}
		return corev1.ConditionFalse
	}
	for _, n := range []clonev1beta1.Condition{
		{Type: clonev1beta1.ConditionProgressing, Status: status(progressing), Reason: reason, LastProbeTime: now, LastTransitionTime: now},
		{Type: clonev1beta1.ConditionReady, Status: status(ready), Reason: reason, LastProbeTime: now, LastTransitionTime: now},
	} {
		found := false
		for i := range vc.Status.Conditions {
			if vc.Status.Conditions[i].Type == n.Type {
				found = true
				if vc.Status.Conditions[i].Status == n.Status && vc.Status.Conditions[i].Reason == n.Reason {
					break
				}
				if vc.Status.Conditions[i].Status == n.Status {
					n.LastTransitionTime = vc.Status.Conditions[i].LastTransitionTime
				}
				vc.Status.Conditions[i] = n
			}
		}
		if !found {
			vc.Status.Conditions = append(vc.Status.Conditions, n)
		}
	}
}

func ownedBy(vc *clonev1beta1.VirtualMachineClone) []metav1.OwnerReference {
	yes := true
	return []metav1.OwnerReference{{APIVersion: clonev1beta1.SchemeGroupVersion.String(), Kind: clonev1beta1.VirtualMachineCloneKind.Kind,
		Name: vc.Name, UID: vc.UID, Controller: &yes, BlockOwnerDeletion: &yes}}
}
