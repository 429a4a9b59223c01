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
// Not done: adopting matching orphans, spec.paused, pools' update,
// scale-in and autohealing strategies, nameGeneration.
package replicas

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"time"

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

// Config configures the controller.
type Config struct {
	Virt *client.Set
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
	cacheWaitPeriod time.Duration
}

// New validates cfg and registers with the informers.
func New(cfg Config) (*Controller, error) {
	if cfg.Virt == nil || cfg.VMIs == nil || cfg.VMs == nil {
		return nil, errors.New("replicas: the client set and the VMI and VM informers are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	c := &Controller{cfg: cfg, cacheWaitPeriod: 10 * time.Second,
		sets:  cfg.Virt.VMIReplicaSets.Informer("", 0, nil),
		pools: cfg.Virt.VMPools.Informer("", 0, nil)}
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
	var active []*kubevirtv1.VirtualMachineInstance
	var gone []string
	for _, vmi := range members {
		switch {
		case vmi.DeletionTimestamp != nil:
		case vmi.IsFinal():
			gone = append(gone, vmi.Name)
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
	if surplus := len(active) - want; surplus > 0 {
		for _, vmi := range active[:surplus] {
			gone = append(gone, vmi.Name)
		}
		active = active[surplus:]
	}
	for _, name := range gone {
		if err := c.cfg.Virt.VMIs.Delete(ctx, rs.Namespace, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("replica set %s: delete vmi %s: %w", key, name, err)
		}
		c.cfg.Log.Info("replica set vmi deleted", "namespace", rs.Namespace, "replicaset", rs.Name, "vmi", name)
	}
	var made []string
	for range want - len(active) {
		vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{GenerateName: rs.Name, Namespace: rs.Namespace,
			Labels: rs.Spec.Template.ObjectMeta.Labels, Annotations: rs.Spec.Template.ObjectMeta.Annotations,
			OwnerReferences: controllerRef(kubevirtv1.GroupVersion.String(), "VirtualMachineInstanceReplicaSet", rs.Name, rs.UID)},
			Spec: *rs.Spec.Template.Spec.DeepCopy()}
		if err := admission.AdmitVMICreate(vmi, c.cfg.CPUModels.Get(), c.cfg.MemoryOvercommit.Get(), c.cfg.Rollout.Get()); err != nil {
			return fmt.Errorf("replica set %s: create vmi: %w", key, err)
		}
		created, err := c.cfg.Virt.VMIs.Create(ctx, vmi)
		if err != nil {
			return fmt.Errorf("replica set %s: create vmi: %w", key, err)
		}
		made = append(made, created.Name)
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
	if st.Replicas == rs.Status.Replicas && st.ReadyReplicas == rs.Status.ReadyReplicas && st.LabelSelector == rs.Status.LabelSelector {
		return nil
	}
	upd := rs.DeepCopy()
	upd.Status = st
	if _, err := c.cfg.Virt.VMIReplicaSets.UpdateStatus(ctx, upd); err != nil {
		return fmt.Errorf("replica set %s: write status: %w", key, err)
	}
	return nil
}

func (c *Controller) syncPool(ctx context.Context, key string) error {
	obj, exists, err := c.pools.GetStore().GetByKey(key)
	if err != nil || !exists {
		return err
	}
	pool := obj.(*poolv1beta1.VirtualMachinePool)
	if pool.DeletionTimestamp != nil || pool.Spec.VirtualMachineTemplate == nil || pool.Spec.Selector == nil {
		return nil
	}
	sel, err := metav1.LabelSelectorAsSelector(pool.Spec.Selector)
	if err != nil {
		return fmt.Errorf("pool %s: selector: %w", key, err)
	}
	members, err := owned[*kubevirtv1.VirtualMachine](c.cfg.VMs.GetIndexer(), pool.Namespace, pool.UID, sel)
	if err != nil {
		return err
	}
	byIndex := map[int]*kubevirtv1.VirtualMachine{}
	var indexes []int
	for _, vm := range members {
		i, ok := poolIndex(pool.Name, vm.Name)
		if !ok || vm.DeletionTimestamp != nil {
			continue
		}
		byIndex[i] = vm
		indexes = append(indexes, i)
	}
	sort.Ints(indexes)
	want := replicasOf(pool.Spec.Replicas)
	var gone, made []string
	// Scale down: the highest indexes go.
	for len(indexes) > want {
		vm := byIndex[indexes[len(indexes)-1]]
		indexes = indexes[:len(indexes)-1]
		if err := c.cfg.Virt.VMs.Delete(ctx, pool.Namespace, vm.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("pool %s: delete vm %s: %w", key, vm.Name, err)
		}
		gone = append(gone, vm.Name)
		c.cfg.Log.Info("pool vm deleted", "namespace", pool.Namespace, "pool", pool.Name, "vm", vm.Name)
	}
	// Scale up: the lowest free indexes.
	tmpl := pool.Spec.VirtualMachineTemplate
	for i := 0; len(indexes)+len(made) < want; i++ {
		if byIndex[i] != nil {
			continue
		}
		vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: pool.Name + "-" + strconv.Itoa(i), Namespace: pool.Namespace,
			Labels: tmpl.ObjectMeta.Labels, Annotations: tmpl.ObjectMeta.Annotations,
			OwnerReferences: controllerRef(poolv1beta1.SchemeGroupVersion.String(), poolv1beta1.VirtualMachinePoolKind, pool.Name, pool.UID)},
			Spec: *tmpl.Spec.DeepCopy()}
		_, err := c.cfg.Virt.VMs.Create(ctx, vm)
		switch {
		case apierrors.IsAlreadyExists(err):
			// Another owner's VM, or ours not yet in the cache: a later
			// sync sees which.
			continue
		case err != nil:
			return fmt.Errorf("pool %s: create vm %s: %w", key, vm.Name, err)
		}
		made = append(made, vm.Name)
		c.cfg.Log.Info("pool vm created", "namespace", pool.Namespace, "pool", pool.Name, "vm", vm.Name)
	}
	if err := c.awaitCache(ctx, c.cfg.VMs.GetStore(), pool.Namespace, made, gone); err != nil {
		return fmt.Errorf("pool %s: %w", key, err)
	}
	ready := 0
	for _, i := range indexes {
		if byIndex[i].Status.Ready {
			ready++
		}
	}
	st := pool.Status
	st.Replicas, st.ReadyReplicas, st.LabelSelector = int32(len(indexes)+len(made)), int32(ready), sel.String()
	if st.Replicas == pool.Status.Replicas && st.ReadyReplicas == pool.Status.ReadyReplicas && st.LabelSelector == pool.Status.LabelSelector {
		return nil
	}
	upd := pool.DeepCopy()
	upd.Status = st
	if _, err := c.cfg.Virt.VMPools.UpdateStatus(ctx, upd); err != nil {
		return fmt.Errorf("pool %s: write status: %w", key, err)
	}
	return nil
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
