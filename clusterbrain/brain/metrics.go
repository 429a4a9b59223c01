package brain

import (
	"context"
	"log/slog"
	"time"

	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/clusterbrain/migration"
)

// DefaultMetricsAddr is where the brain serves /metrics: loopback only. The
// endpoints carry no authentication (namespaces and names of every VM are
// in them); an operator who wants them scraped from elsewhere sets the
// address and puts an authenticating proxy or a network policy in front.
const DefaultMetricsAddr = "127.0.0.1:8484"

// newMetricsServer serves the default registry on addr with the VMI
// collectors (kubevirt_vmi_info, kubevirt_vmi_phase_count) and
// virt-controller's kubevirt_vmi_non_evictable and migration families over
// informers of the VMIs and migrations of all namespaces and of the
// KubeVirt CR (its default evictionStrategy). The VMIs' is the brain's,
// run by the brain (a cache of every VMI is the largest a brain keeps);
// the others are the server's own.
func newMetricsServer(addr string, virt *client.Set, vmiInf cache.SharedIndexInformer, log *slog.Logger) *metrics.Server {
	kvInf := virt.KubeVirts.Informer("", 10*time.Minute, nil)
	migInf := virt.Migrations.Informer("", 10*time.Minute, nil)
	vmis := func() []*kubevirtv1.VirtualMachineInstance {
		var out []*kubevirtv1.VirtualMachineInstance
		for _, o := range vmiInf.GetStore().List() {
			if vmi, ok := o.(*kubevirtv1.VirtualMachineInstance); ok {
				out = append(out, vmi)
			}
		}
		return out
	}
	reg := metrics.Default()
	reg.Register(metrics.VMICollector(vmis))
	reg.Register(nonEvictableCollector(vmis, kvInf.GetStore()))
	reg.Register(metrics.MigrationCollector(func() []*kubevirtv1.VirtualMachineInstanceMigration {
		var out []*kubevirtv1.VirtualMachineInstanceMigration
		for _, o := range migInf.GetStore().List() {
			if m, ok := o.(*kubevirtv1.VirtualMachineInstanceMigration); ok {
				out = append(out, m)
			}
		}
		return out
	}))
	return &metrics.Server{Addr: addr, Registry: reg, Log: log, Start: func(ctx context.Context) {
		go kvInf.Run(ctx.Done())
		go migInf.Run(ctx.Done())
	}}
}

// nonEvictableCollector exposes kubevirt_vmi_non_evictable{node,namespace,name}
// as virt-controller does: 1 for a running VMI whose eviction strategy is
// LiveMigrate but that cannot migrate (it would stay on a draining node),
// 0 for the others.
func nonEvictableCollector(vmis func() []*kubevirtv1.VirtualMachineInstance, kvs cache.Store) metrics.Collector {
	return metrics.CollectorFunc(func() []metrics.Family {
		var crs []*kubevirtv1.KubeVirt
		for _, o := range kvs.List() {
			if kv, ok := o.(*kubevirtv1.KubeVirt); ok {
				crs = append(crs, kv)
			}
		}
		def := migration.ClusterEvictionStrategy(crs)
		f := metrics.Family{Name: "kubevirt_vmi_non_evictable", Type: metrics.TypeGauge,
			Help: "Indication for a VirtualMachine that its eviction strategy is set to Live Migration but is not migratable."}
		for _, vmi := range vmis() {
			if vmi.IsFinal() {
				continue
			}
			v := 0.0
			if migration.NonEvictable(vmi, def) {
				v = 1
			}
			f.Samples = append(f.Samples, metrics.Sample{Labels: []metrics.Label{
				{Name: "node", Value: vmi.Status.NodeName}, {Name: "namespace", Value: vmi.Namespace}, {Name: "name", Value: vmi.Name}}, Value: v})
		}
		return []metrics.Family{f}
	})
}
