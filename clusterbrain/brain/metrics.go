package brain

import (
	"context"
	"log/slog"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// DefaultMetricsAddr is where the brain serves /metrics: loopback only. The
// endpoints carry no authentication (namespaces and names of every VM are
// in them); an operator who wants them scraped from elsewhere sets the
// address and puts an authenticating proxy or a network policy in front.
const DefaultMetricsAddr = "127.0.0.1:8484"

// newMetricsServer serves the default registry on addr with the VMI
// collectors (kubevirt_vmi_info, kubevirt_vmi_phase_count) over a VMI
// informer of all namespaces.
func newMetricsServer(addr string, virt *client.Set, log *slog.Logger) *metrics.Server {
	inf := virt.VMIs.Informer("", 10*time.Minute, nil)
	reg := metrics.Default()
	reg.Register(metrics.VMICollector(func() []*kubevirtv1.VirtualMachineInstance {
		var out []*kubevirtv1.VirtualMachineInstance
		for _, o := range inf.GetStore().List() {
			if vmi, ok := o.(*kubevirtv1.VirtualMachineInstance); ok {
				out = append(out, vmi)
			}
		}
		return out
	}))
	return &metrics.Server{Addr: addr, Registry: reg, Log: log, Start: func(ctx context.Context) { go inf.Run(ctx.Done()) }}
}
