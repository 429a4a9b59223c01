package brain

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
)

// termInformer is one term of leadership's view of an informer that lives
// as long as the brain: the VMIs', which the metrics server reads on every
// brain and the leader's roles share, so a leading brain keeps one watch
// and one cache of the VMIs instead of two. The term's roles add their
// handlers and indexes when they are built (for the first term, before the
// brain leads); the handlers are put on the informer when the term starts,
// each then getting every object already there as an Add (as from a new
// informer's first list), and taken off when the term ends. Indexes stay:
// an index a later term's role adds again under the same name is the one
// already there.
type termInformer struct {
	cache.SharedIndexInformer
	mu       sync.Mutex
	handlers []*termHandler
	// started and ended are the term's start and end.
	started, ended bool
}

var _ cache.SharedIndexInformer = (*termInformer)(nil)

// termHandler is a role's handler, registered on the informer while the
// term runs.
type termHandler struct {
	h       cache.ResourceEventHandler
	options cache.HandlerOptions
	resync  *time.Duration // set by AddEventHandlerWithResyncPeriod
	reg     atomic.Pointer[cache.ResourceEventHandlerRegistration]
}

// HasSynced reports that the term started and the handler got every
// object the informer held then.
func (h *termHandler) HasSynced() bool {
	reg := h.reg.Load()
	return reg != nil && (*reg).HasSynced()
}

func newTermInformer(inf cache.SharedIndexInformer) *termInformer {
	return &termInformer{SharedIndexInformer: inf}
}

func (t *termInformer) AddEventHandler(h cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	return t.add(&termHandler{h: h})
}

func (t *termInformer) AddEventHandlerWithResyncPeriod(h cache.ResourceEventHandler, resync time.Duration) (cache.ResourceEventHandlerRegistration, error) {
	return t.add(&termHandler{h: h, resync: &resync})
}

func (t *termInformer) AddEventHandlerWithOptions(h cache.ResourceEventHandler, options cache.HandlerOptions) (cache.ResourceEventHandlerRegistration, error) {
	return t.add(&termHandler{h: h, options: options})
}

func (t *termInformer) add(h *termHandler) (cache.ResourceEventHandlerRegistration, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		return nil, errors.New("handler added to an ended term's informer")
	}
	if t.started {
		if err := h.register(t.SharedIndexInformer); err != nil {
			return nil, err
		}
	}
	t.handlers = append(t.handlers, h)
	return h, nil
}

// register puts h on inf.
func (h *termHandler) register(inf cache.SharedIndexInformer) error {
	var reg cache.ResourceEventHandlerRegistration
	var err error
	if h.resync != nil {
		reg, err = inf.AddEventHandlerWithResyncPeriod(h.h, *h.resync)
	} else {
		reg, err = inf.AddEventHandlerWithOptions(h.h, h.options)
	}
	if err != nil {
		return err
	}
	h.reg.Store(&reg)
	return nil
}

func (t *termInformer) RemoveEventHandler(handle cache.ResourceEventHandlerRegistration) error {
	h, ok := handle.(*termHandler)
	if !ok {
		return errors.New("not a handler of this term")
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, th := range t.handlers {
		if th == h {
			t.handlers = append(t.handlers[:i], t.handlers[i+1:]...)
			if reg := h.reg.Load(); reg != nil {
				return t.SharedIndexInformer.RemoveEventHandler(*reg)
			}
			return nil
		}
	}
	return nil
}

// RunWithContext runs the term: it puts the roles' handlers on the
// informer (which the brain runs) and takes them off when ctx ends.
func (t *termInformer) RunWithContext(ctx context.Context) {
	t.mu.Lock()
	t.started = true
	for _, h := range t.handlers {
		// Refused only by a stopped informer: the brain is ending.
		_ = h.register(t.SharedIndexInformer)
	}
	t.mu.Unlock()
	<-ctx.Done()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ended = true
	for _, h := range t.handlers {
		if reg := h.reg.Load(); reg != nil {
			_ = t.SharedIndexInformer.RemoveEventHandler(*reg)
		}
	}
}

func (t *termInformer) Run(stopCh <-chan struct{}) { t.RunWithContext(wait.ContextForChannel(stopCh)) }

// HasSynced reports that the informer is filled and every role's handler
// got what it held when the term started.
func (t *termInformer) HasSynced() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.started || !t.SharedIndexInformer.HasSynced() {
		return false
	}
	for _, h := range t.handlers {
		if !h.HasSynced() {
			return false
		}
	}
	return true
}

// IsStopped reports that the term ended (or the informer stopped).
func (t *termInformer) IsStopped() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ended || t.SharedIndexInformer.IsStopped()
}

// AddIndexers adds the indexes the informer does not have yet.
func (t *termInformer) AddIndexers(indexers cache.Indexers) error {
	have := t.GetIndexer().GetIndexers()
	add := cache.Indexers{}
	for name, f := range indexers {
		if _, ok := have[name]; !ok {
			add[name] = f
		}
	}
	if len(add) == 0 {
		return nil
	}
	return t.SharedIndexInformer.AddIndexers(add)
}
