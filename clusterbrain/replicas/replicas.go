// Package replicas keeps KubeVirt's replicated kinds at their count: a
// VirtualMachineInstanceReplicaSet keeps spec.replicas VMIs made from its
// template (names generated from the replica set's name), a
// VirtualMachinePool keeps spec.replicas VMs named <pool>-<index> (the
// lowest free indexes). Each member carries its owner's labels from the
// template and a controller owner reference, so it is garbage collected
// with its owner; members are counted by owner reference and selector.
// Scale down deletes the surplus: a replica set's not-ready VMIs first,
// then its newest; a pool's highest indexes. A replica set's finished VMIs
// (Succeeded, Failed) are deleted and replaced. Status carries replicas,
// readyReplicas and the canonical labelSelector the scale subresource
// reads, so `kubectl scale vmirs/NAME --replicas=N` works.
//
// A replica set's VMIs are made as the VMI webhooks would make them, which
// leave the brain's own creates out: the KubeVirt CR's default CPU model
// and memory overcommit applied, and a template they refuse refused
// (admission.AdmitVMICreate), as upstream's virt-api does to virt-
// controller's creates. A pool makes VMs, whose VMIs the VM controller
// makes the same way.
//
// Each create and delete is an Event on the owner, with KubeVirt's reasons
// and messages (SuccessfulCreate, FailedCreate, SuccessfulDelete,
// FailedDelete). A sync that cannot bring the members to the count (a
// refused create, a failed delete) sets the owner's ReplicaFailure
// condition, as KubeVirt's controllers do: a replica set's reason is
// FailedCreate or FailedDelete with the API error as message, a pool's
// FailedScaleOut or FailedScaleIn ("error during scale out: ...", also sent
// as an Event). The first sync that succeeds removes it; the failed one is
// retried with back-off, and a change of the owner syncs it at once.
//
// Not done: adopting matching orphans, spec.paused, pools' update,
// scale-in and autohealing strategies, nameGeneration.
package replicas

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
	poolv1beta1 "kubevirt.io/api/pool/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// The reasons of the Events and ReplicaFailure conditions, KubeVirt's.
const (
	reasonSuccessfulCreate = "SuccessfulCreate"
	reasonFailedCreate     = "FailedCreate"
	reasonSuccessfulDelete = "SuccessfulDelete"
	reasonFailedDelete     = "FailedDelete"
	reasonFailedScaleOut   = "FailedScaleOut"
	reasonFailedScaleIn    = "FailedScaleIn"
)

// Config configures the controller.
type Config struct {
	Virt *client.Set
	// Kube writes the owners' Events.
	Kube controller.EventsClient
	// VMIs and VMs are the shared informers of all VMIs and VMs (run by
	// their owner).
	VMIs, VMs cache.SharedIndexInformer
	// CPUModels and MemoryOvercommit are the KubeVirt CR's, applied to
	// the replica sets' VMIs (nil: no KubeVirt CR).
	CPUModels        *live.Value[cpumodel.Cluster]
	MemoryOvercommit *live.Value[overcommit.Memory]
	// Rollout is the KubeVirt CR's rollout settings: the maxSockets its
	// VMIs get for CPU hotplug.
	Rollout *live.Value[rollout.Cluster]
	Log     *slog.Logger
}

// Controller runs the replica set and the pool queues.
type Controller struct {
	cfg             Config
	sets, pools     cache.SharedIndexInformer
	setQ, poolQ     *controller.Queue
	recorder        *controller.Recorder
	cacheWaitPeriod time.Duration
}

// New validates cfg and registers with the informers.
func New(cfg Config) (*Controller, error) {
	if cfg.Virt == nil || cfg.Kube == nil || cfg.VMIs == nil || cfg.VMs == nil {
		return nil, errors.New("replicas: the clients and the VMI and VM informers are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	c := &Controller{cfg: cfg, cacheWaitPeriod: 10 * time.Second,
		recorder: controller.NewRecorder(client.NewScheme(), "nodevirt-replicas"),
		sets:     cfg.Virt.VMIReplicaSets.Informer("", 0, nil),
		pools:    cfg.Virt.VMPools.Informer("", 0, nil)}
	var err error
	if c.setQ, err = controller.New(controller.Config{Name: "vmi-replicasets", Sync: controller.NoRequeue(c.syncSet),
		Backoff: controller.BackoffAPI, Log: cfg.Log, KeyAttr: "replicaset", Quiet: apierrors.IsConflict}); err != nil {
		return nil, err
	}
	if c.poolQ, err = controller.New(controller.Config{Name: "vm-pools", Sync: controller.NoRequeue(c.syncPool),
		Backoff: controller.BackoffAPI, Log: cfg.Log, KeyAttr: "pool", Quiet: apierrors.IsConflict}); err != nil {
		return nil, err
	}
	for _, reg := range []struct {
		inf cache.SharedIndexInformer
		h   cache.ResourceEventHandler
	}{
		{c.sets, controller.OnAddOrUpdate(c.setQ.Enqueue)},
		{c.pools, controller.OnAddOrUpdate(c.poolQ.Enqueue)},
		{cfg.VMIs, controller.OnChange(ownerEnqueuer(c.setQ, "VirtualMachineInstanceReplicaSet"))},
		{cfg.VMs, controller.OnChange(ownerEnqueuer(c.poolQ, poolv1beta1.VirtualMachinePoolKind))},
	} {
		if _, err := reg.inf.AddEventHandler(reg.h); err != nil {
			return nil, fmt.Errorf("replicas: register handler: %w", err)
		}
	}
	return c, nil
}

func ownerEnqueuer(q *controller.Queue, kind string) func(any) {
	return func(obj any) {
		if key, ok := controller.OwnerKey(obj, kind); ok {
			q.Add(key)
		}
	}
}

// Name implements the brain's Role.
func (c *Controller) Name() string { return "replicas" }

// Run runs the informers of both kinds and works both queues until ctx
// ends.
func (c *Controller) Run(ctx context.Context) error {
	defer c.recorder.Start(c.cfg.Kube)()
	go c.sets.RunWithContext(ctx)
	go c.pools.RunWithContext(ctx)
	errs := make(chan error, 2)
	go func() { errs <- c.setQ.Run(ctx, c.sets.HasSynced, c.cfg.VMIs.HasSynced) }()
	go func() { errs <- c.poolQ.Run(ctx, c.pools.HasSynced, c.cfg.VMs.HasSynced) }()
	return errors.Join(<-errs, <-errs)
}

// owned returns the objects of store in ns that obj (uid) controls and
// its selector matches.
func owned[T metav1.Object](store cache.Indexer, ns string, uid types.UID, sel labels.Selector) ([]T, error) {
	objs, err := store.ByIndex(cache.NamespaceIndex, ns)
	if err != nil {
		return nil, fmt.Errorf("list members: %w", err)
	}
	var out []T
	for _, o := range objs {
		m, ok := o.(T)
		if !ok {
			continue
		}
		ref := metav1.GetControllerOf(m)
		if ref == nil || ref.UID != uid || !sel.Matches(labels.Set(m.GetLabels())) {
			continue
		}
		out = append(out, m)
	}
	return out, nil
}

func controllerRef(apiVersion, kind, name string, uid types.UID) []metav1.OwnerReference {
	yes := true
	return []metav1.OwnerReference{{APIVersion: apiVersion, Kind: kind, Name: name, UID: uid,
		Controller: &yes, BlockOwnerDeletion: &yes}}
}

func (c *Controller) syncSet(ctx context.Context, key string) error {
	obj, exists, err := c.sets.GetStore().GetByKey(key)
	if err != nil || !exists {
		return err
	}
	rs := obj.(*kubevirtv1.VirtualMachineInstanceReplicaSet)
	if rs.DeletionTimestamp != nil || rs.Spec.Template == nil || rs.Spec.Selector == nil {
		return nil
	}
	sel, err := metav1.LabelSelectorAsSelector(rs.Spec.Selector)
	if err != nil {
		return fmt.Errorf("replica set %s: selector: %w", key, err)
	}
	members, err := owned[*kubevirtv1.VirtualMachineInstance](c.cfg.VMIs.GetIndexer(), rs.Namespace, rs.UID, sel)
	if err != nil {
		return err
	}
	var active, finished []*kubevirtv1.VirtualMachineInstance
	for _, vmi := range members {
		switch {
		case vmi.DeletionTimestamp != nil:
		case vmi.IsFinal():
			finished = append(finished, vmi)
		default:
			active = append(active, vmi)
		}
	}
	want := replicasOf(rs.Spec.Replicas)
	// Not ready first, then newest: the cheapest to lose.
	sort.SliceStable(active, func(i, j int) bool {
		ri, rj := vmiReady(active[i]), vmiReady(active[j])
		if ri != rj {
			return !ri
		}
		return active[j].CreationTimestamp.Before(&active[i].CreationTimestamp)
	})
	var surplus []*kubevirtv1.VirtualMachineInstance
	if n := len(active) - want; n > 0 {
		surplus, active = active[:n], active[n:]
	}
	var made, gone []string
	var failed *scaleFailure
	for _, vmi := range slices.Concat(surplus, finished) {
		if err := c.cfg.Virt.VMIs.Delete(ctx, rs.Namespace, vmi.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			c.recorder.Eventf(rs, corev1.EventTypeWarning, reasonFailedDelete, "Error deleting virtual machine instance %s: %v", vmi.Name, err)
			failed = &scaleFailure{reasonFailedDelete, err}
			break
		}
		gone = append(gone, vmi.Name)
		if vmi.IsFinal() {
			c.recorder.Eventf(rs, corev1.EventTypeNormal, reasonSuccessfulDelete, "Deleted finished virtual machine: %s", vmi.UID)
		} else {
			c.recorder.Eventf(rs, corev1.EventTypeNormal, reasonSuccessfulDelete, "Stopped the virtual machine by deleting the virtual machine instance %s", vmi.UID)
		}
		c.cfg.Log.Info("replica set vmi deleted", "namespace", rs.Namespace, "replicaset", rs.Name, "vmi", vmi.Name)
	}
	for range want - len(active) {
		if failed != nil {
			break
		}
		created, err := c.createMember(ctx, rs)
		if err != nil {
			c.recorder.Eventf(rs, corev1.EventTypeWarning, reasonFailedCreate, "Error creating virtual machine instance: %v", err)
			failed = &scaleFailure{reasonFailedCreate, err}
			break
		}
		made = append(made, created.Name)
		c.recorder.Eventf(rs, corev1.EventTypeNormal, reasonSuccessfulCreate, "Started the virtual machine by creating the new virtual machine instance %s", created.Name)
		c.cfg.Log.Info("replica set vmi created", "namespace", rs.Namespace, "replicaset", rs.Name, "vmi", created.Name)
	}
	// The next sync counts from the cache: wait until it shows these
	// writes, so a VMI is never made twice for one missing replica.
	if err := c.awaitCache(ctx, c.cfg.VMIs.GetStore(), rs.Namespace, made, gone); err != nil {
		return fmt.Errorf("replica set %s: %w", key, err)
	}
	ready := 0
	for _, vmi := range active {
		if vmiReady(vmi) {
			ready++
		}
	}
	st := rs.Status
	st.Replicas, st.ReadyReplicas, st.LabelSelector = int32(len(active)+len(made)), int32(ready), sel.String()
	st.Conditions, _ = withFailure(st.Conditions, failed, func(c kubevirtv1.VirtualMachineInstanceReplicaSetCondition) bool {
		return c.Type == kubevirtv1.VirtualMachineInstanceReplicaSetReplicaFailure
	}, func(reason, message string) kubevirtv1.VirtualMachineInstanceReplicaSetCondition {
		return kubevirtv1.VirtualMachineInstanceReplicaSetCondition{Type: kubevirtv1.VirtualMachineInstanceReplicaSetReplicaFailure,
			Status: corev1.ConditionTrue, Reason: reason, Message: message, LastTransitionTime: metav1.Now()}
	})
	if !equality.Semantic.DeepEqual(st, rs.Status) {
		upd := rs.DeepCopy()
		upd.Status = st
		if _, err := c.cfg.Virt.VMIReplicaSets.UpdateStatus(ctx, upd); err != nil {
			return errors.Join(failed.wrap("replica set "+key), fmt.Errorf("replica set %s: write status: %w", key, err))
		}
	}
	return failed.wrap("replica set " + key)
}

// createMember creates one VMI from rs's template, admitted as the VMI
// webhooks would admit it.
func (c *Controller) createMember(ctx context.Context, rs *kubevirtv1.VirtualMachineInstanceReplicaSet) (*kubevirtv1.VirtualMachineInstance, error) {
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{GenerateName: rs.Name, Namespace: rs.Namespace,
		Labels: rs.Spec.Template.ObjectMeta.Labels, Annotations: rs.Spec.Template.ObjectMeta.Annotations,
		OwnerReferences: controllerRef(kubevirtv1.GroupVersion.String(), "VirtualMachineInstanceReplicaSet", rs.Name, rs.UID)},
		Spec: *rs.Spec.Template.Spec.DeepCopy()}
	if err := admission.AdmitVMICreate(vmi, c.cfg.CPUModels.Get(), c.cfg.MemoryOvercommit.Get(), c.cfg.Rollout.Get()); err != nil {
		return nil, err
	}
	return c.cfg.Virt.VMIs.Create(ctx, vmi)
}

// awaitCache waits until store holds every name of made and every name of
// gone is absent or being deleted.
func (c *Controller) awaitCache(ctx context.Context, store cache.Store, ns string, made, gone []string) error {
	if len(made)+len(gone) == 0 {
		return nil
	}
	err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, c.cacheWaitPeriod, true, func(context.Context) (bool, error) {
		for _, n := range made {
			if _, ok, _ := store.GetByKey(ns + "/" + n); !ok {
				return false, nil
			}
		}
		for _, n := range gone {
			if o, ok, _ := store.GetByKey(ns + "/" + n); ok && o.(metav1.Object).GetDeletionTimestamp() == nil {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("cache did not show the writes: %w", err)
	}
	return nil
}

// poolIndex is the index of a pool's VM name <pool>-<index>.
func poolIndex(pool, vm string) (int, bool) {
	if len(vm) <= len(pool)+1 || vm[:len(pool)+1] != pool+"-" {
		return 0, false
	}
	i, err := strconv.Atoi(vm[len(pool)+1:])
	return i, err == nil && i >= 0 && strconv.Itoa(i) == vm[len(pool)+1:]
}

// replicasOf is spec.replicas, 1 when unset (KubeVirt's default).
func replicasOf(r *int32) int {
	if r == nil {
		return 1
	}
	return max(int(*r), 0)
}

func vmiReady(vmi *kubevirtv1.VirtualMachineInstance) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstanceReady {
			return c.Status == "True"
		}
	}
	return false
}
