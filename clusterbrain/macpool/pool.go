// Package macpool is the kubemacpool role: every bridge or masquerade
// interface of a VirtualMachine gets a unique MAC address from the
// configured range when the VM is admitted. Each address is persisted as a
// MACAllocation named after it before the VM is admitted — creating that
// object is the uniqueness check — so no crash at any point can hand one
// address out twice; a reconciler frees allocations no VM uses any more.
package macpool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/apis/client"
	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/macpool/api/v1alpha1"
)

// OptOutLabel on a namespace with value "ignore" keeps its VMs out of the
// pool (kubemacpool's label).
const OptOutLabel = "mutatevirtualmachines.kubemacpool.io"

// Config configures a Pool.
type Config struct {
	RestConfig *rest.Config
	Virt       *client.Set
	// Namespace holds the HyperConverged whose kubeMacPoolConfiguration is
	// the fallback range.
	Namespace string
	// HyperConverged names it (default kubevirt-hyperconverged).
	HyperConverged string
	// Grace is how long an allocation no VM uses is kept, covering
	// admissions still in flight (default 1m).
	Grace time.Duration
	Log   *slog.Logger
}

func (c *Config) defaults() error {
	if c.RestConfig == nil || c.Virt == nil {
		return errors.New("macpool: rest config and clients are required")
	}
	if c.HyperConverged == "" {
		c.HyperConverged = "kubevirt-hyperconverged"
	}
	if c.Grace == 0 {
		c.Grace = time.Minute
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	return nil
}

// Pool hands out addresses. Every brain runs one for its webhook; its view
// of what is taken comes from an informer plus its own fresh claims, and
// the API server's create is the final arbiter.
type Pool struct {
	cfg    Config
	store  *store
	allocs cache.SharedIndexInformer
	ranges *rangeSource
	synced chan struct{}

	mu     sync.Mutex
	rng    Range
	cursor uint64
	fresh  map[uint64]time.Time // claimed here, perhaps not yet in the informer

	// crashAfterPersist, in tests, makes an admission fail right after its
	// allocations are persisted, as if the brain died there.
	crashAfterPersist func() bool
}

// New builds a pool; Run starts it.
func New(cfg Config) (*Pool, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	st, err := newStore(cfg.RestConfig)
	if err != nil {
		return nil, err
	}
	p := &Pool{cfg: cfg, store: st, allocs: st.informer(0), rng: DefaultRange, fresh: map[uint64]time.Time{},
		synced: make(chan struct{})}
	p.ranges = newRangeSource(cfg.Virt, cfg.Namespace, cfg.HyperConverged, p.setRange)
	_, _ = p.allocs.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { p.forget(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			p.forget(obj)
		},
	})
	return p, nil
}

// forget drops a local claim once the informer reflects the allocation.
func (p *Pool) forget(obj any) {
	a, ok := obj.(*macv1alpha1.MACAllocation)
	if !ok {
		return
	}
	if m, err := ParseMAC(a.Spec.MAC); err == nil {
		p.mu.Lock()
		delete(p.fresh, m)
		p.mu.Unlock()
	}
}

func (p *Pool) setRange(r Range) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r != p.rng {
		p.cfg.Log.Info("mac range", "range", r.String())
		p.rng = r
		p.cursor = 0
	}
}

// Range returns the range in force.
func (p *Pool) Range() Range {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rng
}

// Run keeps the pool's view current until ctx ends.
func (p *Pool) Run(ctx context.Context) error {
	go p.allocs.RunWithContext(ctx)
	if !p.ranges.run(ctx) || !cache.WaitForCacheSync(ctx.Done(), p.allocs.HasSynced) {
		return ctx.Err()
	}
	close(p.synced)
	<-ctx.Done()
	return nil
}

// Usage is the pool's occupancy, for metrics.
type Usage struct {
	Range Range
	// Used counts allocations inside the range; Outside those outside it
	// (explicit addresses or an older range).
	Used, Outside, Total uint64
}

// Usage reports how full the pool is.
func (p *Pool) Usage() Usage {
	r := p.Range()
	u := Usage{Range: r, Total: r.Size()}
	for _, obj := range p.allocs.GetStore().List() {
		m, err := ParseMAC(obj.(*macv1alpha1.MACAllocation).Spec.MAC)
		if err != nil {
			continue
		}
		if r.Contains(m) {
			u.Used++
		} else {
			u.Outside++
		}
	}
	return u
}

// Owner identifies the VM an address is for.
type Owner struct {
	Namespace, Name string
}

func (o Owner) String() string { return o.Namespace + "/" + o.Name }

// ErrExhausted is returned when every address of the range is taken.
var ErrExhausted = errors.New("mac pool exhausted")

func (p *Pool) takenLocked(m uint64, now time.Time) bool {
	if t, ok := p.fresh[m]; ok && now.Sub(t) < 2*time.Minute {
		return true
	}
	_, ok, _ := p.allocs.GetStore().GetByKey(macv1alpha1.NameFor(hwOf(m)))
	return ok
}

// next picks an address that looks free and claims it locally.
func (p *Pool) next(now time.Time) (uint64, Range, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.rng
	size := r.Size()
	for i := uint64(0); i < size; i++ {
		m := r.Start + (p.cursor+i)%size
		if !p.takenLocked(m, now) {
			p.cursor = (m - r.Start + 1) % size
			p.fresh[m] = now
			return m, r, nil
		}
	}
	return 0, r, fmt.Errorf("%w: all %d addresses of %s are in use", ErrExhausted, size, r)
}

func newAllocation(m uint64, o Owner, iface string) *macv1alpha1.MACAllocation {
	return &macv1alpha1.MACAllocation{
		TypeMeta:   metav1.TypeMeta{APIVersion: macv1alpha1.SchemeGroupVersion.String(), Kind: "MACAllocation"},
		ObjectMeta: metav1.ObjectMeta{Name: macv1alpha1.NameFor(hwOf(m)), Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
		Spec:       macv1alpha1.MACAllocationSpec{MAC: FormatMAC(m), Namespace: o.Namespace, VMName: o.Name, Interface: iface},
	}
}

// allocate persists a fresh address for o. dryRun picks one without
// persisting it.
func (p *Pool) allocate(ctx context.Context, o Owner, iface string, dryRun bool) (*macv1alpha1.MACAllocation, error) {
	for attempt := 0; ; attempt++ {
		m, r, err := p.next(time.Now())
		if err != nil {
			return nil, err
		}
		a := newAllocation(m, o, iface)
		if dryRun {
			p.mu.Lock()
			delete(p.fresh, m)
			p.mu.Unlock()
			return a, nil
		}
		created, err := p.store.create(ctx, a)
		if err == nil {
			return created, nil
		}
		if !apierrors.IsAlreadyExists(err) {
			p.mu.Lock()
			delete(p.fresh, m)
			p.mu.Unlock()
			return nil, fmt.Errorf("persist mac %s: %w", FormatMAC(m), err)
		}
		// Taken by another brain or not yet in our informer: keep the local
		// claim so we skip it, and go on.
		if uint64(attempt) > r.Size() {
			return nil, fmt.Errorf("%w: all %d addresses of %s are in use", ErrExhausted, r.Size(), r)
		}
	}
}

// claim persists an explicitly requested address for o; it fails when
// another VM holds it.
func (p *Pool) claim(ctx context.Context, m uint64, o Owner, iface string, dryRun bool) (*macv1alpha1.MACAllocation, error) {
	a := newAllocation(m, o, iface)
	if dryRun {
		if cur, ok, _ := p.allocs.GetStore().GetByKey(a.Name); ok && !ownedBy(cur.(*macv1alpha1.MACAllocation), o) {
			return nil, inUse(m, cur.(*macv1alpha1.MACAllocation))
		}
		return a, nil
	}
	created, err := p.store.create(ctx, a)
	if err == nil {
		return created, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("persist mac %s: %w", FormatMAC(m), err)
	}
	cur, err := p.store.get(ctx, a.Name)
	if err != nil {
		return nil, fmt.Errorf("read allocation of mac %s: %w", FormatMAC(m), err)
	}
	if ownedBy(cur, o) {
		return nil, nil // already ours (a retried create or an update)
	}
	if !p.stale(ctx, cur) {
		return nil, inUse(m, cur)
	}
	// The holder is gone for longer than the grace: take it over, guarded
	// by resourceVersion against a concurrent taker.
	cur = cur.DeepCopy()
	cur.Spec = a.Spec
	updated, err := p.store.update(ctx, cur)
	if err != nil {
		return nil, fmt.Errorf("mac address %s is being claimed concurrently: %w", FormatMAC(m), err)
	}
	return updated, nil
}

func ownedBy(a *macv1alpha1.MACAllocation, o Owner) bool {
	return o.Name != "" && a.Spec.Namespace == o.Namespace && a.Spec.VMName == o.Name
}

func inUse(m uint64, a *macv1alpha1.MACAllocation) error {
	holder := a.Spec.Namespace + "/" + a.Spec.VMName
	if a.Spec.VMName == "" {
		holder = "a virtual machine being created in namespace " + a.Spec.Namespace
	}
	return fmt.Errorf("mac address %s is already in use by %s", FormatMAC(m), holder)
}

// stale reports whether a is older than the grace and its named holder no
// longer has the address (checked against the API, not a cache).
func (p *Pool) stale(ctx context.Context, a *macv1alpha1.MACAllocation) bool {
	if a.Spec.VMName == "" || time.Since(allocatedAt(a)) < p.cfg.Grace {
		return false
	}
	vm, err := p.cfg.Virt.VMs.Get(ctx, a.Spec.Namespace, a.Spec.VMName)
	if apierrors.IsNotFound(err) {
		return true
	}
	if err != nil {
		return false
	}
	return !hasMAC(vm, a.Spec.MAC)
}

// allocatedAt is when a last changed hands.
func allocatedAt(a *macv1alpha1.MACAllocation) time.Time {
	t := a.CreationTimestamp.Time
	for _, mf := range a.ManagedFields {
		if mf.Time != nil && mf.Time.After(t) {
			t = mf.Time.Time
		}
	}
	return t
}

func hasMAC(vm *kubevirtv1.VirtualMachine, mac string) bool {
	for _, m := range vmMACs(vm) {
		if m == mac {
			return true
		}
	}
	return false
}

// vmMACs lists the normalised addresses of vm's interfaces.
func vmMACs(vm *kubevirtv1.VirtualMachine) []string {
	if vm.Spec.Template == nil {
		return nil
	}
	var out []string
	for _, iface := range vm.Spec.Template.Spec.Domain.Devices.Interfaces {
		if m, err := ParseMAC(iface.MacAddress); err == nil {
			out = append(out, FormatMAC(m))
		}
	}
	return out
}

// release deletes allocations made by a failed admission (best effort;
// the reconciler frees whatever is left).
func (p *Pool) release(ctx context.Context, made []*macv1alpha1.MACAllocation) {
	for _, a := range made {
		if err := p.store.delete(ctx, a); err != nil && !apierrors.IsNotFound(err) {
			p.cfg.Log.Warn("release mac", "mac", a.Spec.MAC, "err", err)
		}
	}
}

func hwOf(m uint64) []byte {
	hw := make([]byte, 6)
	for i := 5; i >= 0; i-- {
		hw[i] = byte(m)
		m >>= 8
	}
	return hw
}

// ReadUsage reads the pool's occupancy straight from the API (the range in
// force and every allocation), for callers that run no Pool, such as a
// metrics endpoint. cfg needs RestConfig, Virt and Namespace.
func ReadUsage(ctx context.Context, cfg Config) (Usage, error) {
	if err := cfg.defaults(); err != nil {
		return Usage{}, err
	}
	st, err := newStore(cfg.RestConfig)
	if err != nil {
		return Usage{}, err
	}
	r := DefaultRange
	if nac, err := cfg.Virt.NetworkAddonsConfigs.Get(ctx, "", "cluster"); err == nil && nac.Spec.KubeMacPool != nil && nac.Spec.KubeMacPool.RangeStart != "" {
		if got, err := ParseRange(nac.Spec.KubeMacPool.RangeStart, nac.Spec.KubeMacPool.RangeEnd); err == nil {
			r = got
		}
	} else if hco, err := cfg.Virt.HyperConvergeds.Get(ctx, cfg.Namespace, cfg.HyperConverged); err == nil {
		if c := hco.Spec.KubeMacPoolConfiguration; c != nil && c.RangeStart != nil && c.RangeEnd != nil {
			if got, err := ParseRange(*c.RangeStart, *c.RangeEnd); err == nil {
				r = got
			}
		}
	}
	items, err := st.list(ctx)
	if err != nil {
		return Usage{}, fmt.Errorf("list mac allocations: %w", err)
	}
	u := Usage{Range: r, Total: r.Size()}
	for _, a := range items {
		if m, err := ParseMAC(a.Spec.MAC); err == nil {
			if r.Contains(m) {
				u.Used++
			} else {
				u.Outside++
			}
		}
	}
	return u, nil
}
