// Package vmsnapshot is KubeVirt's snapshot controller on nodevirt's CSI
// snapshots: a VirtualMachineSnapshot of a VM becomes a
// VirtualMachineSnapshotContent (the VM's spec and, per claim-backed
// volume, the claim and a CSI VolumeSnapshot the node's snapshotter takes),
// and a VirtualMachineRestore turns such a content back into a VM, the same
// one (stopped) or a new one (spec.target), on claims restored from those
// VolumeSnapshots.
//
// A snapshot of a running VM is online (indication Online): when the
// guest agent is connected the guest's file systems are frozen through the
// VMI's node (indication GuestAgent) until every VolumeSnapshot is cut,
// otherwise the disks are taken as they are (NoGuestAgent). While a
// snapshot runs the VM's status.snapshotInProgress names it; while a
// restore runs, status.restoreInProgress.
//
// Object names follow KubeVirt: content vmsnapshot-content-<snapshot UID>,
// VolumeSnapshots vmsnapshot-<snapshot UID>-volume-<volume>, restored
// claims restore-<restore UID>-<volume> (RandomizeNames) or
// <target>-<volume> (PrefixTargetName).
package vmsnapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	volsnapv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// Finalizers, KubeVirt's names.
const (
	// SnapshotFinalizer keeps a VirtualMachineSnapshot until its content
	// is dealt with per its deletionPolicy and the VM is unlocked.
	SnapshotFinalizer = "snapshot.kubevirt.io/vmsnapshot-protection"
	// RestoreFinalizer keeps a VirtualMachineRestore until the target VM
	// is unlocked.
	RestoreFinalizer = "snapshot.kubevirt.io/vmrestore-protection"
)

// Freezer freezes and thaws a running VMI's guest file systems (through
// the guest agent, on the VMI's node). Without one, online snapshots are
// taken without a freeze even when an agent is connected.
type Freezer interface {
	Freeze(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error
	Unfreeze(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error
}

// Config configures the controller.
type Config struct {
	Virt *client.Set
	Kube kubernetes.Interface
	// Snapshots reads and writes the CSI snapshot objects.
	Snapshots *volsnapv1.Client
	// VMs and VMIs are the shared informers of all VMs and VMIs (run by
	// their owner).
	VMs, VMIs cache.SharedIndexInformer
	// Freezer may be nil (see Freezer).
	Freezer Freezer
	Log     *slog.Logger
	// Now defaults to time.Now.
	Now func() time.Time
}

// Controller runs the snapshot and the restore queues.
type Controller struct {
	cfg                          Config
	log                          *slog.Logger
	snapshots, contents, restore cache.SharedIndexInformer
	volumeSnapshots              cache.SharedIndexInformer
	snapQ, restoreQ              *controller.Queue
}

// New validates cfg and registers with the informers.
func New(cfg Config) (*Controller, error) {
	if cfg.Virt == nil || cfg.Kube == nil || cfg.Snapshots == nil || cfg.VMs == nil || cfg.VMIs == nil {
		return nil, errors.New("vmsnapshot: the clients and the VM and VMI informers are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	c := &Controller{cfg: cfg, log: cfg.Log,
		snapshots:       cfg.Virt.VMSnapshots.Informer("", 0, nil),
		contents:        cfg.Virt.VMSnapshotContents.Informer("", 0, nil),
		restore:         cfg.Virt.VMRestores.Informer("", 0, nil),
		volumeSnapshots: cfg.Snapshots.Snapshots.Informer(0)}
	var err error
	if c.snapQ, err = controller.New(controller.Config{Name: "vm-snapshots", Sync: c.syncSnapshot,
		Backoff: controller.BackoffAPI, Log: cfg.Log, KeyAttr: "vmsnapshot", Quiet: apierrors.IsConflict}); err != nil {
		return nil, err
	}
	if c.restoreQ, err = controller.New(controller.Config{Name: "vm-restores", Sync: c.syncRestore,
		Backoff: controller.BackoffAPI, Log: cfg.Log, KeyAttr: "vmrestore", Quiet: apierrors.IsConflict}); err != nil {
		return nil, err
	}
	for _, reg := range []struct {
		inf cache.SharedIndexInformer
		h   cache.ResourceEventHandler
	}{
		{c.snapshots, controller.OnAddOrUpdate(c.snapQ.Enqueue)},
		{c.contents, controller.OnChange(c.enqueueContentSnapshot)},
		{c.volumeSnapshots, controller.OnChange(c.enqueueVolumeSnapshot)},
		{c.restore, controller.OnAddOrUpdate(c.restoreQ.Enqueue)},
		// A restore waits for its target VM to stop.
		{cfg.VMs, controller.OnChange(c.enqueueRestoresOf)},
		{cfg.VMIs, controller.OnChange(c.enqueueRestoresOf)},
	} {
		if _, err := reg.inf.AddEventHandler(reg.h); err != nil {
			return nil, fmt.Errorf("vmsnapshot: register handler: %w", err)
		}
	}
	return c, nil
}

// Name implements the brain's Role.
func (c *Controller) Name() string { return "vm-snapshots" }

// Run runs the informers of the snapshot kinds and works both queues
// until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	for _, inf := range []cache.SharedIndexInformer{c.snapshots, c.contents, c.restore, c.volumeSnapshots} {
		go inf.RunWithContext(ctx)
	}
	synced := []cache.InformerSynced{c.snapshots.HasSynced, c.contents.HasSynced, c.restore.HasSynced,
		c.volumeSnapshots.HasSynced, c.cfg.VMs.HasSynced, c.cfg.VMIs.HasSynced}
	errs := make(chan error, 2)
	go func() { errs <- c.snapQ.Run(ctx, synced...) }()
	go func() { errs <- c.restoreQ.Run(ctx, synced...) }()
	return errors.Join(<-errs, <-errs)
}

// enqueueContentSnapshot queues the snapshot a content belongs to.
func (c *Controller) enqueueContentSnapshot(obj any) {
	if ct, ok := controller.Unwrap(obj).(*snapv1beta1.VirtualMachineSnapshotContent); ok && ct.Spec.VirtualMachineSnapshotName != nil {
		c.snapQ.Add(ct.Namespace + "/" + *ct.Spec.VirtualMachineSnapshotName)
	}
}

// enqueueVolumeSnapshot queues the snapshot whose content owns a
// VolumeSnapshot.
func (c *Controller) enqueueVolumeSnapshot(obj any) {
	vs, ok := controller.Unwrap(obj).(*volsnapv1.VolumeSnapshot)
	if !ok {
		return
	}
	if name := vs.Labels[labelSnapshot]; name != "" {
		c.snapQ.Add(vs.Namespace + "/" + name)
	}
}

// enqueueRestoresOf queues the unfinished restores whose target is the VM
// (or the VMI's VM).
func (c *Controller) enqueueRestoresOf(obj any) {
	m, ok := controller.Unwrap(obj).(metav1.Object)
	if !ok {
		return
	}
	objs, err := c.restore.GetIndexer().ByIndex(cache.NamespaceIndex, m.GetNamespace())
	if err != nil {
		return
	}
	for _, o := range objs {
		r := o.(*snapv1beta1.VirtualMachineRestore)
		if r.Spec.Target.Name == m.GetName() && !restoreComplete(r) {
			c.restoreQ.Add(r.Namespace + "/" + r.Name)
		}
	}
}

// labelSnapshot names, on a VolumeSnapshot, the VirtualMachineSnapshot it
// was taken for.
const labelSnapshot = "snapshot.kubevirt.io/source-vm-snapshot"

// get returns the object of key in inf's store, nil when it is gone.
func get[T any](inf cache.SharedIndexInformer, key string) (T, bool, error) {
	var zero T
	o, ok, err := inf.GetStore().GetByKey(key)
	if err != nil || !ok {
		return zero, false, err
	}
	t, ok := o.(T)
	return t, ok, nil
}

func (c *Controller) vm(ns, name string) (*kubevirtv1.VirtualMachine, error) {
	vm, _, err := get[*kubevirtv1.VirtualMachine](c.cfg.VMs, ns+"/"+name)
	return vm, err
}

func (c *Controller) vmi(ns, name string) (*kubevirtv1.VirtualMachineInstance, error) {
	vmi, _, err := get[*kubevirtv1.VirtualMachineInstance](c.cfg.VMIs, ns+"/"+name)
	return vmi, err
}

// lockVM sets the VM's status field (snapshotInProgress or
// restoreInProgress) to owner when it is free; it reports false when
// another operation holds the VM. The write carries the VM's
// resourceVersion, so two operations cannot both take it.
func (c *Controller) lockVM(ctx context.Context, vm *kubevirtv1.VirtualMachine, field, owner string) (bool, error) {
	cur := vm.Status.SnapshotInProgress
	if field == "restoreInProgress" {
		cur = vm.Status.RestoreInProgress
	}
	if cur != nil {
		return *cur == owner, nil
	}
	if other := busyWith(vm); other != "" {
		return false, nil
	}
	patch := map[string]any{"metadata": map[string]any{"resourceVersion": vm.ResourceVersion},
		"status": map[string]any{field: owner}}
	if err := c.patchVMStatus(ctx, vm, patch); err != nil {
		return false, err
	}
	return true, nil
}

// busyWith names the snapshot or restore that holds vm, "" when none.
func busyWith(vm *kubevirtv1.VirtualMachine) string {
	if s := vm.Status.SnapshotInProgress; s != nil {
		return "snapshot " + *s
	}
	if r := vm.Status.RestoreInProgress; r != nil {
		return "restore " + *r
	}
	return ""
}

// unlockVM clears the VM's field when owner holds it.
func (c *Controller) unlockVM(ctx context.Context, ns, name, field, owner string) error {
	vm, err := c.cfg.Virt.VMs.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	cur := vm.Status.SnapshotInProgress
	if field == "restoreInProgress" {
		cur = vm.Status.RestoreInProgress
	}
	if cur == nil || *cur != owner {
		return nil
	}
	return c.patchVMStatus(ctx, vm, map[string]any{"metadata": map[string]any{"resourceVersion": vm.ResourceVersion},
		"status": map[string]any{field: nil}})
}

func (c *Controller) patchVMStatus(ctx context.Context, vm *kubevirtv1.VirtualMachine, patch map[string]any) error {
	data, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	if _, err := c.cfg.Virt.VMs.Patch(ctx, vm.Namespace, vm.Name, types.MergePatchType, data, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("vm %s/%s status: %w", vm.Namespace, vm.Name, err)
	}
	return nil
}

// condition returns a KubeVirt snapshot condition stamped now.
func (c *Controller) condition(t snapv1beta1.ConditionType, status bool, reason string) snapv1beta1.Condition {
	s := corev1.ConditionFalse
	if status {
		s = corev1.ConditionTrue
	}
	now := metav1.NewTime(c.cfg.Now())
	return snapv1beta1.Condition{Type: t, Status: s, Reason: reason, LastProbeTime: now, LastTransitionTime: now}
}

// setConditions replaces or appends each of set in conds, keeping the
// transition time of a condition whose status did not change.
func setConditions(conds []snapv1beta1.Condition, set ...snapv1beta1.Condition) []snapv1beta1.Condition {
next:
	for _, n := range set {
		for i := range conds {
			if conds[i].Type == n.Type {
				if conds[i].Status == n.Status {
					if conds[i].Reason == n.Reason {
						continue next
					}
					n.LastTransitionTime = conds[i].LastTransitionTime
				}
				conds[i] = n
				continue next
			}
		}
		conds = append(conds, n)
	}
	return conds
}

func removeFinalizer(fins []string, f string) []string {
	out := fins[:0:0]
	for _, x := range fins {
		if x != f {
			out = append(out, x)
		}
	}
	return out
}

func hasFinalizer(fins []string, f string) bool {
	for _, x := range fins {
		if x == f {
			return true
		}
	}
	return false
}
