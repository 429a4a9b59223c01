package macpool

import (
	"sync"
	"sync/atomic"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// servedPool is the pool whose occupancy the default registry reports: the
// last one started (a brain runs one).
var (
	servedPool   atomic.Pointer[Pool]
	registerOnce sync.Once
)

// serveUsage makes p's occupancy part of the default registry's scrape:
// nodevirt_mac_pool_size, nodevirt_mac_pool_used and
// nodevirt_mac_pool_outside_range (allocations outside the current range:
// explicitly requested addresses, or an older range's).
func serveUsage(p *Pool) {
	servedPool.Store(p)
	registerOnce.Do(func() {
		metrics.Default().Register(metrics.CollectorFunc(func() []metrics.Family {
			p := servedPool.Load()
			if p == nil {
				return nil
			}
			u := p.Usage()
			gauge := func(name, help string, v uint64) metrics.Family {
				return metrics.Family{Name: name, Help: help, Type: metrics.TypeGauge,
					Samples: []metrics.Sample{{Value: float64(v)}}}
			}
			return []metrics.Family{
				gauge("nodevirt_mac_pool_size", "Addresses in the MAC pool's range.", u.Total),
				gauge("nodevirt_mac_pool_used", "Allocated addresses inside the MAC pool's range.", u.Used),
				gauge("nodevirt_mac_pool_outside_range", "Allocated addresses outside the MAC pool's range.", u.Outside),
			}
		}))
	})
}
