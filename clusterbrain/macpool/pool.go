// Package macpool is the kubemacpool role: every bridge or masquerade
// interface of a VirtualMachine gets a unique MAC address from the
// configured range when the VM is admitted. Addresses are persisted in
// block MACAllocations (one object per aligned run of 16 addresses,
// written with its resourceVersion as precondition — the uniqueness check)
// before the VM is admitted, so no crash at any point can hand one address
// out twice; concurrent admissions share one write per block (group
// commit, see commit.go); a reconciler frees entries no VM uses any more.
package macpool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/api/macpool/v1alpha1"
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
	// VMInformer, when set, is an informer of all VMs shared with other
	// roles, which the caller runs (the reconciler's; nil: it makes and
	// runs its own).
	VMInformer cache.SharedIndexInformer
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

	reqs chan *commitReq
	// planMu makes commit rounds choose addresses one at a time.
	planMu sync.Mutex

	mu     sync.Mutex
	rng    Range
	cursor uint64
	// latest is this pool's own newest copy of blocks it wrote or re-read
	// (nil: known not to exist), until the informer catches up.
	latest map[string]*macv1alpha1.MACAllocation
	busy   map[string]bool // blocks a commit round is writing

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
	p := &Pool{cfg: cfg, store: st, allocs: st.informer(0), rng: DefaultRange, reqs: make(chan *commitReq),
		latest: map[string]*macv1alpha1.MACAllocation{}, busy: map[string]bool{}, synced: make(chan struct{})}
	p.ranges = newRangeSource(cfg.Virt, cfg.Namespace, cfg.HyperConverged, p.setRange)
	_, _ = p.allocs.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.observe(obj) },
		UpdateFunc: func(_, obj any) { p.observe(obj) },
	})
	return p, nil
}

func (p *Pool) observe(obj any) {
	if a, ok := obj.(*macv1alpha1.MACAllocation); ok && a.IsBlock() {
		p.observed(a)
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
	p.runCommitters(ctx)
	serveUsage(p)
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
		u.count(r, obj.(*macv1alpha1.MACAllocation))
	}
	return u
}

// count adds the addresses a records.
func (u *Usage) count(r Range, a *macv1alpha1.MACAllocation) {
	for _, mac := range addresses(a) {
		m, err := ParseMAC(mac)
		if err != nil {
			continue
		}
		if r.Contains(m) {
			u.Used++
		} else {
			u.Outside++
		}
	}
}

// addresses lists the addresses a records: a block's entries, or a
// single-address record's own.
func addresses(a *macv1alpha1.MACAllocation) []string {
	if !a.IsBlock() {
		return []string{a.Spec.MAC}
	}
	out := make([]string, len(a.Spec.Entries))
	for i, e := range a.Spec.Entries {
		out[i] = e.MAC
	}
	return out
}

// Owner identifies the VM an address is for.
type Owner struct {
	Namespace, Name string
}

func (o Owner) String() string { return o.Namespace + "/" + o.Name }

// ErrExhausted is returned when every address of the range is taken.
var ErrExhausted = errors.New("mac pool exhausted")

func ownedBy(a *macv1alpha1.MACAllocation, o Owner) bool {
	return o.Name != "" && a.Spec.Namespace == o.Namespace && a.Spec.VMName == o.Name
}

// takenError says an explicitly requested address belongs to another VM.
type takenError struct{ msg string }

func (e *takenError) Error() string { return e.msg }

func inUse(m uint64, namespace, vmName string) error {
	holder := namespace + "/" + vmName
	if vmName == "" {
		holder = "a virtual machine being created in namespace " + namespace
	}
	return &takenError{msg: fmt.Sprintf("mac address %s is already in use by %s", FormatMAC(m), holder)}
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
	for i := range items {
		u.count(r, &items[i])
	}
	return u, nil
}
