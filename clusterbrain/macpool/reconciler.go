package macpool

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/api/macpool/v1alpha1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

const macIndex = "mac"

// Reconciler is the pool's leader role: it fills in the owner of each
// allocation and frees allocations no VirtualMachine uses once they are
// older than the grace (admissions in flight), on VM deletion or
// interface edits, and at start for whatever a crash left behind.
type Reconciler struct {
	cfg    Config
	store  *store
	vms    cache.SharedIndexInformer
	allocs cache.SharedIndexInformer
	queue  *controller.Queue
	ownVMs bool // the reconciler runs the VM informer
}

// NewReconciler builds the reconciler.
func NewReconciler(cfg Config) (*Reconciler, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	st, err := newStore(cfg.RestConfig)
	if err != nil {
		return nil, err
	}
	r := &Reconciler{cfg: cfg, store: st,
		vms:    cfg.VMInformer,
		allocs: st.informer(5 * time.Minute),
	}
	if r.queue, err = controller.New(controller.Config{Name: "macpool", Sync: r.Sync, Backoff: controller.BackoffAPI,
		Workers: 4, Log: cfg.Log, KeyAttr: "allocation"}); err != nil {
		return nil, err
	}
	if r.vms == nil {
		r.vms, r.ownVMs = cfg.Virt.VMs.Informer("", 0, nil), true
	}
	if err := r.vms.AddIndexers(cache.Indexers{macIndex: func(obj any) ([]string, error) {
		return vmMACs(obj.(*kubevirtv1.VirtualMachine)), nil
	}}); err != nil {
		return nil, err
	}
	enqueueVM := func(obj any) {
		if vm, ok := obj.(*kubevirtv1.VirtualMachine); ok {
			for _, m := range vmMACs(vm) {
				if hw, err := ParseMAC(m); err == nil {
					r.queue.Add(macv1alpha1.BlockName(hw))
					if _, ok, _ := r.allocs.GetStore().GetByKey(macv1alpha1.NameFor(hwOf(hw))); ok {
						r.queue.Add(macv1alpha1.NameFor(hwOf(hw))) // a single-address record
					}
				}
			}
		}
	}
	vmHandlers := controller.OnChange(enqueueVM)
	vmHandlers.UpdateFunc = func(o, n any) { enqueueVM(o); enqueueVM(n) } // a MAC removed frees its allocation
	_, _ = r.vms.AddEventHandler(vmHandlers)
	_, _ = r.allocs.AddEventHandler(controller.OnAddOrUpdate(r.queue.Enqueue))
	return r, nil
}

// Name implements the brain's Role.
func (r *Reconciler) Name() string { return "macpool-reconciler" }

// Run reconciles until ctx ends.
func (r *Reconciler) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	if r.ownVMs {
		go r.vms.RunWithContext(ctx)
	}
	go r.allocs.RunWithContext(ctx)
	return r.queue.Run(ctx, r.vms.HasSynced, r.allocs.HasSynced)
}

// syncBlock records the owners of a block's entries and frees the entries
// no VM has used for longer than the grace, in one write.
func (r *Reconciler) syncBlock(ctx context.Context, a *macv1alpha1.MACAllocation) (time.Duration, error) {
	var after time.Duration
	later := func(d time.Duration) {
		if after == 0 || d < after {
			after = d
		}
	}
	keep := make([]macv1alpha1.MACEntry, 0, len(a.Spec.Entries))
	changed := false
	var freed []macv1alpha1.MACEntry
	for _, e := range a.Spec.Entries {
		users, err := r.vms.GetIndexer().ByIndex(macIndex, e.MAC)
		if err != nil {
			return 0, err
		}
		if len(users) > 1 {
			// Cannot happen through the webhook; report loudly if it does.
			r.cfg.Log.Error("mac address used by several vms", "mac", e.MAC, "vms", len(users))
		}
		if len(users) > 0 {
			vm := users[0].(*kubevirtv1.VirtualMachine)
			for _, u := range users {
				if v := u.(*kubevirtv1.VirtualMachine); v.Namespace == e.Namespace && v.Name == e.VMName {
					vm = v
				}
			}
			// The owner is recorded once it is known; a UID alone is not
			// worth a write during a burst.
			if e.Namespace != vm.Namespace || e.VMName != vm.Name || (e.VMUID != vm.UID && e.VMUID != "") {
				e.Namespace, e.VMName, e.VMUID = vm.Namespace, vm.Name, vm.UID
				changed = true
			}
			keep = append(keep, e)
			continue
		}
		if age := time.Since(e.Since.Time); age < r.cfg.Grace {
			later(r.cfg.Grace - age + 100*time.Millisecond)
			keep = append(keep, e)
			continue
		}
		// The cache says nobody: confirm with the API before freeing.
		if e.VMName != "" {
			vm, err := r.cfg.Virt.VMs.Get(ctx, e.Namespace, e.VMName)
			if err == nil && hasMAC(vm, e.MAC) {
				later(r.cfg.Grace)
				keep = append(keep, e)
				continue
			}
			if err != nil && !apierrors.IsNotFound(err) {
				return 0, err
			}
		}
		changed = true
		freed = append(freed, e)
	}
	if !changed {
		return after, nil
	}
	upd := a.DeepCopy()
	upd.Spec.Entries = keep
	if _, err := r.store.update(ctx, upd); err != nil {
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			return 200 * time.Millisecond, nil // the newer version comes through the informer
		}
		return 0, fmt.Errorf("update mac block %s: %w", a.Name, err)
	}
	for _, e := range freed {
		r.cfg.Log.Info("mac freed", "mac", e.MAC, "namespace", e.Namespace, "name", e.VMName)
	}
	return after, nil
}

// Sync reconciles the allocation named key. It returns a positive
// duration when the allocation must be looked at again later.
func (r *Reconciler) Sync(ctx context.Context, key string) (time.Duration, error) {
	obj, ok, err := r.allocs.GetStore().GetByKey(key)
	if err != nil || !ok {
		return 0, err
	}
	a := obj.(*macv1alpha1.MACAllocation)
	if a.IsBlock() {
		return r.syncBlock(ctx, a)
	}
	users, err := r.vms.GetIndexer().ByIndex(macIndex, a.Spec.MAC)
	if err != nil {
		return 0, err
	}
	if len(users) > 1 {
		// Cannot happen through the webhook; report loudly if it does.
		r.cfg.Log.Error("mac address used by several vms", "mac", a.Spec.MAC, "vms", len(users))
	}
	if len(users) > 0 {
		vm := users[0].(*kubevirtv1.VirtualMachine)
		for _, u := range users {
			if v := u.(*kubevirtv1.VirtualMachine); v.Namespace == a.Spec.Namespace && v.Name == a.Spec.VMName {
				vm = v
			}
		}
		// The owner is recorded once it is known; a UID alone is not worth
		// a write per address during a burst.
		if a.Spec.Namespace == vm.Namespace && a.Spec.VMName == vm.Name && (a.Spec.VMUID == vm.UID || a.Spec.VMUID == "") {
			return 0, nil
		}
		a = a.DeepCopy()
		a.Spec.Namespace, a.Spec.VMName, a.Spec.VMUID = vm.Namespace, vm.Name, vm.UID
		if _, err := r.store.update(ctx, a); err != nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
			return 0, fmt.Errorf("record owner of mac %s: %w", a.Spec.MAC, err)
		}
		return 0, nil
	}
	if age := time.Since(allocatedAt(a)); age < r.cfg.Grace {
		return r.cfg.Grace - age + 100*time.Millisecond, nil
	}
	// The cache says nobody: confirm with the API before freeing.
	if a.Spec.VMName != "" {
		vm, err := r.cfg.Virt.VMs.Get(ctx, a.Spec.Namespace, a.Spec.VMName)
		if err == nil && hasMAC(vm, a.Spec.MAC) {
			return r.cfg.Grace, nil
		}
		if err != nil && !apierrors.IsNotFound(err) {
			return 0, err
		}
	}
	if err := r.store.delete(ctx, a); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return 0, fmt.Errorf("free mac %s: %w", a.Spec.MAC, err)
	}
	r.cfg.Log.Info("mac freed", "mac", a.Spec.MAC, "namespace", a.Spec.Namespace, "name", a.Spec.VMName)
	return 0, nil
}
