package macpool

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/api/macpool/v1alpha1"
)

// Group commit: admissions queue their wants; one committer takes every
// request waiting, chooses addresses for all of them against the latest
// known blocks and writes each touched block once, guarded by its
// resourceVersion. An admission is answered only after the write holding
// its addresses succeeded, so what it returns is persisted; a conflict
// (another brain, the reconciler) re-reads the block and retries the
// requests that depended on it.

// maxBatch bounds the requests one commit round takes.
const maxBatch = 256

// maxRounds bounds the conflict retries of one request.
const maxRounds = 8

// want is one interface's address: mac 0 means any free address.
type want struct {
	mac   uint64
	iface string
}

type commitReq struct {
	owner Owner
	wants []want
	got   []uint64 // persisted address per want
	next  []uint64 // address per want planned in the current round
	err   error
	done  chan struct{}
}

// commit persists addresses for wants and returns them in order.
func (p *Pool) commit(ctx context.Context, o Owner, wants []want) ([]uint64, error) {
	r := &commitReq{owner: o, wants: wants, got: make([]uint64, len(wants)), done: make(chan struct{})}
	select {
	case p.reqs <- r:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case <-r.done:
		return r.got, r.err
	case <-ctx.Done():
		// The committer still answers r; what it persisted is freed by
		// the reconciler once the grace is over.
		return nil, ctx.Err()
	}
}

// committers is how many commit rounds may be writing at once; rounds
// in flight never share a block. Fewer rounds take more requests each and
// write each block fewer times, but requests wait longer for a free
// committer. In the brain benchmark (1,000 VMs from 64 clients) 32 rounds
// wrote 0.7 blocks per VM, 16 wrote 0.5 (webhook 330 ms), 8 wrote 0.33
// (355 ms) and 4 wrote 0.27 but queued requests (490-540 ms).
const committers = 8

// runCommitters serves commit requests until ctx ends.
func (p *Pool) runCommitters(ctx context.Context) {
	for i := 0; i < committers; i++ {
		go p.runCommitter(ctx)
	}
}

func (p *Pool) runCommitter(ctx context.Context) {
	for {
		var batch []*commitReq
		select {
		case r := <-p.reqs:
			batch = append(batch, r)
		case <-ctx.Done():
			return
		}
	more:
		for len(batch) < maxBatch {
			select {
			case r := <-p.reqs:
				batch = append(batch, r)
			default:
				break more
			}
		}
		p.commitBatch(ctx, batch)
	}
}

// workBlock is a block being changed by a commit round.
type workBlock struct {
	obj   *macv1alpha1.MACAllocation // a copy; ResourceVersion "" when new
	taken map[uint64]int             // address → entry index
	dirty bool
}

func newWorkBlock(name string, cur *macv1alpha1.MACAllocation, base uint64) *workBlock {
	w := &workBlock{taken: map[uint64]int{}}
	if cur != nil {
		w.obj = cur.DeepCopy()
	} else {
		w.obj = &macv1alpha1.MACAllocation{
			TypeMeta:   metav1.TypeMeta{APIVersion: macv1alpha1.SchemeGroupVersion.String(), Kind: "MACAllocation"},
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
			Spec:       macv1alpha1.MACAllocationSpec{MAC: FormatMAC(base)},
		}
	}
	for i, e := range w.obj.Spec.Entries {
		if m, err := ParseMAC(e.MAC); err == nil {
			w.taken[m] = i
		}
	}
	return w
}

// round is the working state of one commit round.
type round struct {
	p      *Pool
	ctx    context.Context
	now    metav1.Time
	blocks map[string]*workBlock
	// setHere are the addresses taken in this round (not yet persisted).
	setHere map[uint64]bool
	// rewind is where the next round starts looking when this one
	// skipped a block busy in another round.
	skipped bool
	rewind  uint64
	// dry rounds persist nothing and so need not avoid busy blocks.
	dry bool
}

func (rd *round) block(m uint64) *workBlock {
	name := macv1alpha1.BlockName(m)
	if w, ok := rd.blocks[name]; ok {
		return w
	}
	w := newWorkBlock(name, rd.p.latestBlock(name), m&^(macv1alpha1.BlockSize-1))
	rd.blocks[name] = w
	return w
}

// legacy returns the single-address record of m, if any.
func (p *Pool) legacy(m uint64) *macv1alpha1.MACAllocation {
	if obj, ok, _ := p.allocs.GetStore().GetByKey(macv1alpha1.NameFor(hwOf(m))); ok {
		return obj.(*macv1alpha1.MACAllocation)
	}
	return nil
}

// undo is how to revert one change to a work block.
type undo struct {
	w    *workBlock
	m    uint64
	prev *macv1alpha1.MACEntry // nil: the address was free
}

func (rd *round) set(w *workBlock, m uint64, e macv1alpha1.MACEntry) undo {
	u := undo{w: w, m: m}
	if i, ok := w.taken[m]; ok {
		prev := w.obj.Spec.Entries[i]
		u.prev = &prev
		w.obj.Spec.Entries[i] = e
	} else {
		w.taken[m] = len(w.obj.Spec.Entries)
		w.obj.Spec.Entries = append(w.obj.Spec.Entries, e)
	}
	return u
}

func (u undo) revert() {
	i := u.w.taken[u.m]
	if u.prev != nil {
		u.w.obj.Spec.Entries[i] = *u.prev
		return
	}
	// The entry was appended last by the change being undone.
	last := len(u.w.obj.Spec.Entries) - 1
	u.w.obj.Spec.Entries = u.w.obj.Spec.Entries[:last]
	delete(u.w.taken, u.m)
}

// plan chooses addresses for r's outstanding wants in the work blocks
// (r.next), leaving the blocks as they were when it fails.
func (rd *round) plan(r *commitReq, rng Range, cursor *uint64) error {
	var undos []undo
	fail := func(err error) error {
		for i := len(undos) - 1; i >= 0; i-- {
			undos[i].revert()
			delete(rd.setHere, undos[i].m)
		}
		return err
	}
	take := func(i int, m uint64) {
		w := rd.block(m)
		undos = append(undos, rd.set(w, m, macv1alpha1.MACEntry{MAC: FormatMAC(m), Namespace: r.owner.Namespace,
			VMName: r.owner.Name, Interface: r.wants[i].iface, Since: rd.now}))
		rd.setHere[m] = true
		r.next[i] = m
	}
	r.next = make([]uint64, len(r.wants))
	for i, wnt := range r.wants {
		if r.got[i] != 0 || wnt.mac == 0 {
			continue
		}
		m := wnt.mac
		if l := rd.p.legacy(m); l != nil && !ownedBy(l, r.owner) {
			return fail(inUse(m, l.Spec.Namespace, l.Spec.VMName))
		}
		if rd.busy(m) {
			return fail(errBusy)
		}
		w := rd.block(m)
		if j, ok := w.taken[m]; ok {
			cur := w.obj.Spec.Entries[j]
			mine := r.owner.Name != "" && cur.Namespace == r.owner.Namespace && cur.VMName == r.owner.Name
			switch {
			case mine && !rd.setHere[m]:
				r.got[i] = m // already ours and persisted
				continue
			case rd.setHere[m]:
				return fail(inUse(m, cur.Namespace, cur.VMName)) // requested twice at once
			case !rd.p.staleEntry(rd.ctx, cur):
				return fail(inUse(m, cur.Namespace, cur.VMName))
			}
		}
		take(i, m)
	}
	size := rng.Size()
	for i, wnt := range r.wants {
		if r.got[i] != 0 || wnt.mac != 0 {
			continue
		}
		found := false
		for n := uint64(0); n < size; n++ {
			m := rng.Start + (*cursor+n)%size
			if rd.busy(m) {
				if !rd.skipped {
					// Later rounds come back here once it is written, so
					// blocks fill up instead of one new block per round.
					rd.skipped, rd.rewind = true, max(m&^(macv1alpha1.BlockSize-1), rng.Start)-rng.Start
				}
				n += m | (macv1alpha1.BlockSize - 1) - m // the rest of the block
				continue
			}
			if _, taken := rd.block(m).taken[m]; taken || rd.p.legacy(m) != nil {
				continue
			}
			*cursor = (m - rng.Start + 1) % size
			take(i, m)
			found = true
			break
		}
		if !found {
			return fail(fmt.Errorf("%w: all %d addresses of %s are in use", ErrExhausted, size, rng))
		}
	}
	for _, u := range undos {
		u.w.dirty = true
	}
	return nil
}

// commitBatch answers every request of batch.
func (p *Pool) commitBatch(ctx context.Context, batch []*commitReq) {
	pending := batch
	for attempt := 0; len(pending) > 0; attempt++ {
		rd := &round{p: p, ctx: ctx, now: metav1.Now(), blocks: map[string]*workBlock{}, setHere: map[uint64]bool{}}
		var planned, waiting []*commitReq
		p.planMu.Lock()
		p.mu.Lock()
		rng, cursor := p.rng, p.cursor
		p.mu.Unlock()
		for _, r := range pending {
			err := rd.plan(r, rng, &cursor)
			switch {
			case errors.Is(err, errBusy):
				waiting = append(waiting, r)
			case err != nil:
				r.err = err
				close(r.done)
			default:
				planned = append(planned, r)
			}
		}
		if rd.skipped {
			cursor = rd.rewind
		}
		p.mu.Lock()
		if p.rng == rng {
			p.cursor = cursor
		}
		var mine []string
		for name, w := range rd.blocks {
			if w.dirty {
				p.busy[name] = true
				mine = append(mine, name)
			}
		}
		p.mu.Unlock()
		p.planMu.Unlock()
		t0 := time.Now()
		failed := p.writeBlocks(ctx, rd)
		p.mu.Lock()
		for _, name := range mine {
			delete(p.busy, name)
		}
		p.mu.Unlock()
		p.cfg.Log.Debug("mac commit round", "requests", len(planned), "blocks", len(mine), "failed", len(failed), "took", time.Since(t0))
		pending = waiting
		if len(waiting) > 0 {
			attempt-- // waiting for a block is not a failed round
			time.Sleep(5 * time.Millisecond)
		}
		for _, r := range planned {
			var err error
			for i, m := range r.next {
				if m == 0 {
					continue
				}
				if e, bad := failed[macv1alpha1.BlockName(m)]; bad {
					err = e
				} else {
					r.got[i] = m // persisted
				}
			}
			switch {
			case err == nil:
				close(r.done)
			case attempt+1 >= maxRounds || !retryable(err):
				// What was persisted stays until the reconciler frees it.
				r.err = err
				close(r.done)
			default:
				pending = append(pending, r)
			}
		}
	}
}

func retryable(err error) bool {
	return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err) || apierrors.IsNotFound(err)
}

// writeBlocks writes the dirty blocks of rd in parallel and returns the
// error of each block whose write failed.
func (p *Pool) writeBlocks(ctx context.Context, rd *round) map[string]error {
	var mu sync.Mutex
	failed := map[string]error{}
	var wg sync.WaitGroup
	for name, w := range rd.blocks {
		if !w.dirty {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var got *macv1alpha1.MACAllocation
			var err error
			if w.obj.ResourceVersion == "" {
				got, err = p.store.create(ctx, w.obj)
			} else {
				got, err = p.store.update(ctx, w.obj)
			}
			if err == nil {
				p.setLatest(got)
				return
			}
			if retryable(err) {
				p.refreshBlock(ctx, name)
			}
			mu.Lock()
			failed[name] = fmt.Errorf("persist mac block %s: %w", name, err)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return failed
}

// latestBlock is the freshest copy of a block this pool knows: its own
// last write or the informer's, whichever is newer.
func (p *Pool) latestBlock(name string) *macv1alpha1.MACAllocation {
	var inf *macv1alpha1.MACAllocation
	if obj, ok, _ := p.allocs.GetStore().GetByKey(name); ok {
		inf = obj.(*macv1alpha1.MACAllocation)
	}
	p.mu.Lock()
	own, ok := p.latest[name]
	p.mu.Unlock()
	if !ok {
		return inf
	}
	if own == nil || inf == nil || newer(own, inf) {
		return own
	}
	return inf
}

// newer reports whether a is a later version than b. Resource versions
// are compared as numbers, which etcd-backed servers give; this only
// picks the better starting point, the write's precondition decides.
func newer(a, b *macv1alpha1.MACAllocation) bool {
	x, err1 := strconv.ParseUint(a.ResourceVersion, 10, 64)
	y, err2 := strconv.ParseUint(b.ResourceVersion, 10, 64)
	if err1 != nil || err2 != nil {
		return true
	}
	return x > y
}

func (p *Pool) setLatest(a *macv1alpha1.MACAllocation) {
	p.mu.Lock()
	p.latest[a.Name] = a
	p.mu.Unlock()
}

// refreshBlock reads a block from the API after a failed write (nil when
// it does not exist).
func (p *Pool) refreshBlock(ctx context.Context, name string) {
	cur, err := p.store.get(ctx, name)
	switch {
	case err == nil:
		p.setLatest(cur)
	case apierrors.IsNotFound(err):
		p.mu.Lock()
		p.latest[name] = nil
		p.mu.Unlock()
	default:
		p.mu.Lock()
		delete(p.latest, name)
		p.mu.Unlock()
	}
}

// observed drops the pool's own copy of a block once the informer has
// caught up with it.
func (p *Pool) observed(a *macv1alpha1.MACAllocation) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if own, ok := p.latest[a.Name]; ok && (own == nil || !newer(own, a)) {
		delete(p.latest, a.Name)
	}
}

// staleEntry reports whether e is older than the grace and its named
// holder no longer has the address (checked against the API).
func (p *Pool) staleEntry(ctx context.Context, e macv1alpha1.MACEntry) bool {
	if e.VMName == "" || time.Since(e.Since.Time) < p.cfg.Grace {
		return false
	}
	vm, err := p.cfg.Virt.VMs.Get(ctx, e.Namespace, e.VMName)
	if apierrors.IsNotFound(err) {
		return true
	}
	if err != nil {
		return false
	}
	return !hasMAC(vm, e.MAC)
}

// errBusy: an explicitly requested address is in a block another round
// is writing; the request waits for the next round.
var errBusy = errors.New("mac block busy")

// busy reports whether another round is writing the block of m.
func (rd *round) busy(m uint64) bool {
	if rd.dry {
		return false
	}
	name := macv1alpha1.BlockName(m)
	if _, mine := rd.blocks[name]; mine {
		return false
	}
	rd.p.mu.Lock()
	defer rd.p.mu.Unlock()
	return rd.p.busy[name]
}
