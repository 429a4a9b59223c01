package agent

import (
	"context"

	nodemetrics "github.com/nodevirt/nodevirt/nodeagent/metrics"
)

// newMetricsRole serves /metrics: the per-VMI statistics of this node's
// domains and its VMI phase counts; nothing with MetricsAddr "-".
func newMetricsRole(d *Deps) (Role, error) {
	if d.Config.MetricsAddr == "" {
		return namedRole{"metrics", func(context.Context) error { return nil }}, nil
	}
	s, err := nodemetrics.New(nodemetrics.Config{NodeName: d.Config.NodeName, Addr: d.Config.MetricsAddr,
		LibvirtURI: d.Config.LibvirtURI, Virt: d.Virt, VMIs: d.VMIs, Log: d.Log})
	if err != nil {
		return nil, err
	}
	return s, nil
}
