package vmsnapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"

	volsnapv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
)

// Annotations KubeVirt puts on restored objects.
const (
	// AnnLastRestore is on a restored VM: <restore name>-<restore UID>.
	AnnLastRestore = "restore.kubevirt.io/lastRestoreUID"
	// AnnRestoreName is on a restored claim: the restore's name.
	AnnRestoreName = "restore.kubevirt.io/name"
)

// claimAnnotationsDropped are the prefixes of annotations a restored claim
// does not keep from the snapshotted one (binding and provisioning state).
var claimAnnotationsDropped = []string{"pv.kubernetes.io/", "volume.beta.kubernetes.io/", "volume.kubernetes.io/",
	"cdi.kubevirt.io/", "hostpath.nodevirt.io/"}

func restoreComplete(r *snapv1beta1.VirtualMachineRestore) bool {
	return r.Status != nil && r.Status.Complete != nil && *r.Status.Complete
}

func restoreFailed(r *snapv1beta1.VirtualMachineRestore) bool {
	if r.Status == nil {
		return false
	}
	for _, c := range r.Status.Conditions {
		if c.Type == snapv1beta1.ConditionFailure && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

func (c *Controller) syncRestore(ctx context.Context, key string) (time.Duration, error) {
	cached, ok, err := get[*snapv1beta1.VirtualMachineRestore](c.restore, key)
	if err != nil || !ok {
		return 0, err
	}
	r := cached.DeepCopy()
	if r.DeletionTimestamp != nil {
		if !hasFinalizer(r.Finalizers, RestoreFinalizer) {
			return 0, nil
		}
		if err := c.unlockVM(ctx, r.Namespace, r.Spec.Target.Name, "restoreInProgress", r.Name); err != nil {
			return 0, err
		}
		r.Finalizers = removeFinalizer(r.Finalizers, RestoreFinalizer)
		_, err := c.cfg.Virt.VMRestores.Update(ctx, r)
		if apierrors.IsNotFound(err) {
			err = nil
		}
		return 0, err
	}
	if !restoreComplete(r) && !restoreFailed(r) {
		// The cache may lag behind this controller's last status write:
		// work from the stored object, never redo a finished restore.
		fresh, err := c.cfg.Virt.VMRestores.Get(ctx, r.Namespace, r.Name)
		if apierrors.IsNotFound(err) {
			return 0, nil
		}
		if err != nil {
			return 0, err
		}
		r = fresh
	}
	if restoreComplete(r) || restoreFailed(r) {
		// A sync on a stale cache may have locked the target again.
		return 0, c.unlockVM(ctx, r.Namespace, r.Spec.Target.Name, "restoreInProgress", r.Name)
	}
	if !hasFinalizer(r.Finalizers, RestoreFinalizer) {
		r.Finalizers = append(r.Finalizers, RestoreFinalizer)
		_, err := c.cfg.Virt.VMRestores.Update(ctx, r)
		return 0, err
	}
	if r.Status == nil {
		r.Status = &snapv1beta1.VirtualMachineRestoreStatus{}
	}
	orig := r.Status.DeepCopy()
	after, err := c.progressRestore(ctx, r)
	if !equality.Semantic.DeepEqual(orig, r.Status) {
		if _, uerr := c.cfg.Virt.VMRestores.UpdateStatus(ctx, r); uerr != nil {
			return 0, errors.Join(err, fmt.Errorf("update status: %w", uerr))
		}
	}
	return after, err
}

// waitRestore records on r why it waits.
func (c *Controller) waitRestore(r *snapv1beta1.VirtualMachineRestore, reason string) (time.Duration, error) {
	r.Status.Complete = new(bool)
	r.Status.Conditions = setConditions(r.Status.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, reason),
		c.condition(snapv1beta1.ConditionReady, false, reason))
	return waitRetry, nil
}

// failRestore ends r with message; the target is unlocked.
func (c *Controller) failRestore(ctx context.Context, r *snapv1beta1.VirtualMachineRestore, message string) (time.Duration, error) {
	r.Status.Complete = new(bool)
	fail := c.condition(snapv1beta1.ConditionFailure, true, "Operation failed")
	fail.Message = message
	r.Status.Conditions = setConditions(r.Status.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, "Operation failed"),
		c.condition(snapv1beta1.ConditionReady, false, "Operation failed"), fail)
	c.log.Info("restore failed", "vmrestore", r.Namespace+"/"+r.Name, "reason", message)
	return 0, c.unlockVM(ctx, r.Namespace, r.Spec.Target.Name, "restoreInProgress", r.Name)
}

// progressRestore moves r one step on and records it on r.Status.
func (c *Controller) progressRestore(ctx context.Context, r *snapv1beta1.VirtualMachineRestore) (time.Duration, error) {
	tgt := r.Spec.Target
	if tgt.Kind != "VirtualMachine" || (tgt.APIGroup != nil && *tgt.APIGroup != kubevirtv1.GroupVersion.Group) {
		return c.failRestore(ctx, r, fmt.Sprintf("target kind %s is not supported: only VirtualMachine", tgt.Kind))
	}
	if p := r.Spec.VolumeRestorePolicy; p != nil && *p == snapv1beta1.VolumeRestorePolicyInPlace {
		return c.failRestore(ctx, r, "volumeRestorePolicy InPlace is not supported")
	}
	s, ok, err := get[*snapv1beta1.VirtualMachineSnapshot](c.snapshots, r.Namespace+"/"+r.Spec.VirtualMachineSnapshotName)
	if err != nil {
		return 0, err
	}
	if !ok {
		return c.waitRestore(r, fmt.Sprintf("VMSnapshot %s does not exist", r.Spec.VirtualMachineSnapshotName))
	}
	if s.Status == nil || s.Status.ReadyToUse == nil || !*s.Status.ReadyToUse || s.Status.VirtualMachineSnapshotContentName == nil {
		return c.waitRestore(r, fmt.Sprintf("VMSnapshot %s not ready", s.Name))
	}
	content, ok, err := get[*snapv1beta1.VirtualMachineSnapshotContent](c.contents, r.Namespace+"/"+*s.Status.VirtualMachineSnapshotContentName)
	if err != nil {
		return 0, err
	}
	if !ok || content.Spec.Source.VirtualMachine == nil {
		return c.waitRestore(r, fmt.Sprintf("VMSnapshotContent %s does not exist", *s.Status.VirtualMachineSnapshotContentName))
	}
	vm, err := c.vm(r.Namespace, tgt.Name)
	if err != nil {
		return 0, err
	}
	if vm != nil {
		if after, wait, err := c.targetReady(ctx, r, vm); wait || err != nil {
			return after, err
		}
	}
	// The claims first: a VM never names a claim that does not exist.
	restores, claims, err := c.restoreClaims(ctx, r, content)
	if err != nil {
		return 0, err
	}
	r.Status.Restores = restores
	if pending, err := c.unboundClaim(ctx, r.Namespace, claims); err != nil || pending != "" {
		if err != nil {
			return 0, err
		}
		return c.waitRestore(r, fmt.Sprintf("Waiting for restored claim %s to be bound", pending))
	}
	restored, err := restoredVM(content.Spec.Source.VirtualMachine, claims, r.Spec.Patches)
	if err != nil {
		return c.failRestore(ctx, r, err.Error())
	}
	spec := &restored.Spec
	stamp := r.Name + "-" + string(r.UID)
	if vm == nil {
		nvm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: r.Namespace, Name: tgt.Name,
			Labels: restored.Labels, Annotations: map[string]string{AnnLastRestore: stamp}}, Spec: *spec}
		for k, v := range restored.Annotations {
			if !strings.HasPrefix(k, "kubevirt.io/") && k != "kubectl.kubernetes.io/last-applied-configuration" {
				nvm.Annotations[k] = v
			}
		}
		if vm, err = c.cfg.Virt.VMs.Create(ctx, nvm); err != nil {
			return 0, fmt.Errorf("create vm %s: %w", tgt.Name, err)
		}
		c.log.Info("vm restored as a new vm", "vmrestore", r.Namespace+"/"+r.Name, "vm", tgt.Name)
	} else if vm.Annotations[AnnLastRestore] != stamp {
		old := vm.DeepCopy()
		vm = vm.DeepCopy()
		vm.Spec = *spec
		if vm.Annotations == nil {
			vm.Annotations = map[string]string{}
		}
		vm.Annotations[AnnLastRestore] = stamp
		if vm, err = c.cfg.Virt.VMs.Update(ctx, vm); err != nil {
			return 0, fmt.Errorf("update vm %s: %w", tgt.Name, err)
		}
		deleted, err := c.deleteReplacedDataVolumes(ctx, old, spec)
		if err != nil {
			return 0, err
		}
		r.Status.DeletedDataVolumes = deleted
		c.log.Info("vm restored", "vmrestore", r.Namespace+"/"+r.Name, "vm", tgt.Name)
	}
	if p := r.Spec.VolumeOwnershipPolicy; p == nil || *p == snapv1beta1.VolumeOwnershipPolicyVm {
		if err := c.ownClaims(ctx, vm, claims); err != nil {
			return 0, err
		}
	}
	yes := true
	now := metav1.NewTime(c.cfg.Now())
	r.Status.Complete, r.Status.RestoreTime = &yes, &now
	r.Status.Conditions = setConditions(r.Status.Conditions, c.condition(snapv1beta1.ConditionProgressing, false, "Operation complete"),
		c.condition(snapv1beta1.ConditionReady, true, "Operation complete"))
	return 0, c.unlockVM(ctx, r.Namespace, tgt.Name, "restoreInProgress", r.Name)
}

// targetReady applies the readiness policy to an existing target: it
// must be stopped and free, and is then locked for r. wait is true while r
// cannot go on.
func (c *Controller) targetReady(ctx context.Context, r *snapv1beta1.VirtualMachineRestore, vm *kubevirtv1.VirtualMachine) (time.Duration, bool, error) {
	vmi, err := c.vmi(vm.Namespace, vm.Name)
	if err != nil {
		return 0, true, err
	}
	if vmi != nil {
		policy := snapv1beta1.VirtualMachineRestoreWaitGracePeriodAndFail
		if r.Spec.TargetReadinessPolicy != nil {
			policy = *r.Spec.TargetReadinessPolicy
		}
		switch policy {
		case snapv1beta1.VirtualMachineRestoreFailImmediate:
			after, err := c.failRestore(ctx, r, "restore target VM is running")
			return after, true, err
		case snapv1beta1.VirtualMachineRestoreWaitGracePeriodAndFail:
			if c.cfg.Now().Sub(r.CreationTimestamp.Time) > snapv1beta1.DefaultGracePeriod {
				after, err := c.failRestore(ctx, r, fmt.Sprintf("restore target VM was not stopped within the grace period %s", snapv1beta1.DefaultGracePeriod))
				return after, true, err
			}
		case snapv1beta1.VirtualMachineRestoreStopTarget:
			if err := c.stopVM(ctx, vm); err != nil {
				return 0, true, err
			}
		}
		after, err := c.waitRestore(r, "Waiting for target VM to be stopped")
		return after, true, err
	}
	locked, err := c.lockVM(ctx, vm, "restoreInProgress", r.Name)
	if err != nil {
		return 0, true, err
	}
	if !locked {
		after, err := c.waitRestore(r, "Target VM is busy with "+busyWith(vm))
		return after, true, err
	}
	return 0, false, nil
}

// stopVM sets the VM's run strategy to Halted.
func (c *Controller) stopVM(ctx context.Context, vm *kubevirtv1.VirtualMachine) error {
	if rs := vm.Spec.RunStrategy; rs != nil && *rs == kubevirtv1.RunStrategyHalted {
		return nil
	}
	patch := []byte(`{"spec":{"running":null,"runStrategy":"Halted"}}`)
	if _, err := c.cfg.Virt.VMs.Patch(ctx, vm.Namespace, vm.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("stop vm %s: %w", vm.Name, err)
	}
	return nil
}

// claimName is the restored claim of one volume, per the restore's name
// policy and overrides.
func claimName(r *snapv1beta1.VirtualMachineRestore, volume string) string {
	for _, o := range r.Spec.VolumeRestoreOverrides {
		if o.VolumeName == volume && o.RestoreName != "" {
			return o.RestoreName
		}
	}
	if p := r.Spec.VolumeRestorePolicy; p != nil && *p == snapv1beta1.VolumeRestorePolicyPrefixTargetName {
		return r.Spec.Target.Name + "-" + volume
	}
	return fmt.Sprintf("restore-%s-%s", r.UID, volume)
}

// restoreClaims creates a claim from each of the content's VolumeSnapshots
// and returns the status entries and the claim of each volume.
func (c *Controller) restoreClaims(ctx context.Context, r *snapv1beta1.VirtualMachineRestore, content *snapv1beta1.VirtualMachineSnapshotContent) ([]snapv1beta1.VolumeRestore, map[string]string, error) {
	var restores []snapv1beta1.VolumeRestore
	claims := map[string]string{}
	for _, b := range content.Spec.VolumeBackups {
		if b.VolumeSnapshotName == nil {
			continue
		}
		name := claimName(r, b.VolumeName)
		pvc := restoredClaim(r, b, name)
		// The snapshot's data is on one node: the claim is provisioned
		// there now, so the restore does not depend on the snapshot once
		// it is complete.
		loc, err := c.cfg.Snapshots.Locate(ctx, r.Namespace, *b.VolumeSnapshotName)
		if err != nil {
			return nil, nil, err
		}
		if loc.Node != "" {
			pvc.Annotations[annSelectedNode] = loc.Node
		}
		if _, err := c.cfg.Kube.CoreV1().PersistentVolumeClaims(r.Namespace).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			if !apierrors.IsAlreadyExists(err) {
				return nil, nil, fmt.Errorf("create claim %s: %w", name, err)
			}
			existing, err := c.cfg.Kube.CoreV1().PersistentVolumeClaims(r.Namespace).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return nil, nil, err
			}
			if existing.Annotations[AnnRestoreName] != r.Name {
				return nil, nil, fmt.Errorf("claim %s exists and was not restored by %s", name, r.Name)
			}
		}
		claims[b.VolumeName] = name
		restores = append(restores, snapv1beta1.VolumeRestore{VolumeName: b.VolumeName, PersistentVolumeClaimName: name,
			VolumeSnapshotName: *b.VolumeSnapshotName})
	}
	return restores, claims, nil
}

// annSelectedNode is where a WaitForFirstConsumer claim is provisioned.
const annSelectedNode = "volume.kubernetes.io/selected-node"

// unboundClaim names one of claims that is not bound yet, "" when all are.
func (c *Controller) unboundClaim(ctx context.Context, ns string, claims map[string]string) (string, error) {
	for _, name := range claims {
		pvc, err := c.cfg.Kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return "", err
		}
		if pvc.Status.Phase != corev1.ClaimBound {
			return name, nil
		}
	}
	return "", nil
}

// restoredClaim is the claim restoring backup b under name.
func restoredClaim(r *snapv1beta1.VirtualMachineRestore, b snapv1beta1.VolumeBackup, name string) *corev1.PersistentVolumeClaim {
	src := b.PersistentVolumeClaim
	ann := map[string]string{AnnRestoreName: r.Name}
	for k, v := range src.Annotations {
		drop := k == "kubectl.kubernetes.io/last-applied-configuration"
		for _, p := range claimAnnotationsDropped {
			drop = drop || strings.HasPrefix(k, p)
		}
		if !drop {
			ann[k] = v
		}
	}
	labels := map[string]string{}
	for k, v := range src.Labels {
		labels[k] = v
	}
	for _, o := range r.Spec.VolumeRestoreOverrides {
		if o.VolumeName == b.VolumeName {
			for k, v := range o.Labels {
				labels[k] = v
			}
			for k, v := range o.Annotations {
				ann[k] = v
			}
		}
	}
	group := volsnapv1.GroupName
	ref := corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: *b.VolumeSnapshotName}
	spec := corev1.PersistentVolumeClaimSpec{AccessModes: src.Spec.AccessModes, Resources: src.Spec.Resources,
		StorageClassName: src.Spec.StorageClassName, VolumeMode: src.Spec.VolumeMode, DataSource: &ref,
		DataSourceRef: &corev1.TypedObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: *b.VolumeSnapshotName}}
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: r.Namespace, Name: name,
		Labels: labels, Annotations: ann}, Spec: spec}
}

// restoredVM is the snapshotted VM (labels, annotations, spec) on the
// restored claims, stopped, with patches (RFC 6902 operations on the VM,
// KubeVirt's spec.patches) applied.
func restoredVM(src *snapv1beta1.VirtualMachine, claims map[string]string, patches []string) (*kubevirtv1.VirtualMachine, error) {
	spec := src.Spec.DeepCopy()
	replaced := map[string]bool{}
	if spec.Template == nil {
		return nil, errors.New("the snapshotted vm has no template")
	}
	for i := range spec.Template.Spec.Volumes {
		v := &spec.Template.Spec.Volumes[i]
		claim, ok := claims[v.Name]
		if !ok {
			continue
		}
		if v.DataVolume != nil {
			replaced[v.DataVolume.Name] = true
		}
		v.VolumeSource = kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}
	}
	var templates []kubevirtv1.DataVolumeTemplateSpec
	for _, t := range spec.DataVolumeTemplates {
		if !replaced[t.Name] {
			templates = append(templates, t)
		}
	}
	spec.DataVolumeTemplates = templates
	halted := kubevirtv1.RunStrategyHalted
	spec.Running, spec.RunStrategy = nil, &halted
	vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: src.Name, Namespace: src.Namespace,
		Labels: src.Labels, Annotations: src.Annotations}, Spec: *spec}
	if len(patches) == 0 {
		return vm, nil
	}
	doc, err := json.Marshal(vm)
	if err != nil {
		return nil, err
	}
	ops := "[" + strings.Join(patches, ",") + "]"
	p, err := jsonpatch.DecodePatch([]byte(ops))
	if err != nil {
		return nil, fmt.Errorf("patches: %w", err)
	}
	if doc, err = p.Apply(doc); err != nil {
		return nil, fmt.Errorf("patches: %w", err)
	}
	out := &kubevirtv1.VirtualMachine{}
	if err := json.Unmarshal(doc, out); err != nil {
		return nil, fmt.Errorf("patched vm: %w", err)
	}
	return out, nil
}

// deleteReplacedDataVolumes deletes the DataVolumes of old's templates
// that spec no longer names and that the VM owns.
func (c *Controller) deleteReplacedDataVolumes(ctx context.Context, old *kubevirtv1.VirtualMachine, spec *kubevirtv1.VirtualMachineSpec) ([]string, error) {
	keep := map[string]bool{}
	for _, t := range spec.DataVolumeTemplates {
		keep[t.Name] = true
	}
	var deleted []string
	for _, t := range old.Spec.DataVolumeTemplates {
		if keep[t.Name] {
			continue
		}
		dv, err := c.cfg.Virt.DataVolumes.Get(ctx, old.Namespace, t.Name)
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if ref := metav1.GetControllerOf(dv); ref == nil || ref.UID != old.UID {
			continue
		}
		if err := c.cfg.Virt.DataVolumes.Delete(ctx, old.Namespace, t.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("delete replaced datavolume %s: %w", t.Name, err)
		}
		deleted = append(deleted, t.Name)
	}
	return deleted, nil
}

// ownClaims makes vm the controller of the restored claims, so they go
// with it.
func (c *Controller) ownClaims(ctx context.Context, vm *kubevirtv1.VirtualMachine, claims map[string]string) error {
	for _, name := range claims {
		pvc, err := c.cfg.Kube.CoreV1().PersistentVolumeClaims(vm.Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if metav1.GetControllerOf(pvc) != nil {
			continue
		}
		yes := true
		pvc.OwnerReferences = append(pvc.OwnerReferences, metav1.OwnerReference{APIVersion: kubevirtv1.GroupVersion.String(),
			Kind: "VirtualMachine", Name: vm.Name, UID: vm.UID, Controller: &yes, BlockOwnerDeletion: &yes})
		if _, err := c.cfg.Kube.CoreV1().PersistentVolumeClaims(vm.Namespace).Update(ctx, pvc, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("own claim %s: %w", name, err)
		}
	}
	return nil
}
