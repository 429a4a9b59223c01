package agent

import (
	"context"

	"github.com/nodevirt/nodevirt/nodeagent/handler"
	nodemetrics "github.com/nodevirt/nodevirt/nodeagent/metrics"
)

// newMetricsRole serves /metrics: the per-VMI statistics of this node's
// domains, read over the handler's libvirt connections (the handler role is
// built first), and its VMI phase counts; nothing with MetricsAddr "-".
func newMetricsRole(d *Deps) (Role, error) {
	if d.Config.MetricsAddr == "" {
		return namedRole{"metrics", func(context.Context) error { return nil }}, nil
	}
	var domains nodemetrics.DomainStatsSource
	if d.Handler != nil {
		domains = d.Handler
	}
	s, err := nodemetrics.New(nodemetrics.Config{NodeName: d.Config.NodeName, Addr: d.Config.MetricsAddr,
		Domains: domains, Virt: d.Virt, VMIs: d.VMIs, Log: d.Log})
	if err != nil {
		return nil, err
	}
	return s, nil
}

var _ nodemetrics.DomainStatsSource = (*handler.Handler)(nil)
