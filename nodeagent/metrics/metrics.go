// Package metrics serves the node agent's /metrics: KubeVirt's per-VMI
// metrics (kubevirt_vmi_cpu_*, kubevirt_vmi_vcpu_*, kubevirt_vmi_memory_*,
// kubevirt_vmi_network_*, kubevirt_vmi_storage_*) from the libvirt
// statistics of this node's VMIs, kubevirt_vmi_phase_count of this node's
// VMIs, and whatever the process registers in the shared registry
// (clusterbrain/kit/metrics.Default).
//
// The statistics come from virConnectGetAllDomainStats over the node
// agent's own libvirt connections (Config.Domains), taken at scrape time. A
// domain counts when its name (<namespace>_<name>) names a VMI bound to
// this node and the VMI UID in its metadata is that VMI's; other domains of
// the same libvirtd (another agent's, a hand-made one) are left out. NIC and
// disk statistics are named after the VMI's interface and disk names
// through the domain's user aliases (ua-<name>).
package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	prom "github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// DefaultAddr is where the node agent serves /metrics: loopback only (no
// authentication; see clusterbrain/brain.DefaultMetricsAddr).
const DefaultAddr = "127.0.0.1:8485"

// Config configures a Server.
type Config struct {
	// NodeName is this node; required. Only VMIs labelled
	// kubevirt.io/nodeName=<NodeName> are reported.
	NodeName string
	// Addr is the listen address (DefaultAddr when empty).
	Addr string
	// Domains reads the statistics of the node's domains (the handler's
	// launcher connections); nil exposes no per-VMI statistics, only the
	// phase counts and the shared registry.
	Domains DomainStatsSource
	// Virt is the API client for the node's VMIs; required.
	Virt *client.Set
	// VMIs is the informer of this node's VMIs, shared with other roles
	// and run by whoever made it; nil makes the server its own, run by
	// Run.
	VMIs cache.SharedIndexInformer
	// Log; slog.Default() when nil.
	Log *slog.Logger
}

func (c *Config) defaults() {
	if c.Addr == "" {
		c.Addr = DefaultAddr
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	switch {
	case c.NodeName == "":
		return errors.New("metrics: node name is required")
	case c.Virt == nil:
		return errors.New("metrics: kubevirt client is required")
	}
	return nil
}

// Server serves the node's metrics.
type Server struct {
	cfg      Config
	log      *slog.Logger
	vmis     cache.SharedIndexInformer
	ownVMIs  bool
	registry *prom.Registry

	mu   sync.Mutex
	addr string // once listening
}

// New validates cfg and builds the server; nothing listens or connects
// before Run.
func New(cfg Config) (*Server, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Log.With("role", "metrics", "node", cfg.NodeName)}
	s.vmis, s.ownVMIs = cfg.VMIs, cfg.VMIs == nil
	if s.ownVMIs {
		selector := v1.NodeNameLabel + "=" + cfg.NodeName
		s.vmis = cfg.Virt.VMIs.Informer(metav1.NamespaceAll, 10*time.Minute, func(o *metav1.ListOptions) {
			o.LabelSelector = selector
		})
	}
	s.registry = prom.NewRegistry()
	if cfg.Domains != nil {
		stats := newDomainStats(cfg.Domains, cfg.NodeName, s.nodeVMI, s.log)
		s.registry.Register(DomainCollector(stats.collect))
	}
	s.registry.Register(phaseCounts(prom.VMICollector(s.nodeVMIs)))
	s.registry.Register(prom.CollectorFunc(prom.Default().Gather))
	return s, nil
}

// Name is the role's name.
func (s *Server) Name() string { return "metrics" }

// Addr is the address the server listens on, empty before Run listens.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// Handler serves the metrics in Prometheus' text format.
func (s *Server) Handler() http.Handler { return s.registry.Handler() }

// Run serves /metrics until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	if s.ownVMIs {
		go s.vmis.Run(ctx.Done())
	}
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("metrics listen %s: %w", s.cfg.Addr, err)
	}
	s.mu.Lock()
	s.addr = ln.Addr().String()
	s.mu.Unlock()
	mux := http.NewServeMux()
	mux.Handle("/metrics", s.Handler())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	stop := context.AfterFunc(ctx, func() { _ = srv.Close() })
	defer stop()
	s.log.Info("metrics serving", "addr", s.addr)
	prom.WarnIfExposed(s.log, ln.Addr())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics server: %w", err)
	}
	return nil
}

// nodeVMIs lists this node's VMIs from the informer.
func (s *Server) nodeVMIs() []*v1.VirtualMachineInstance {
	var out []*v1.VirtualMachineInstance
	for _, o := range s.vmis.GetStore().List() {
		if vmi, ok := o.(*v1.VirtualMachineInstance); ok && s.onNode(vmi) {
			out = append(out, vmi)
		}
	}
	return out
}

// nodeVMI is the VMI namespace/name if it is this node's.
func (s *Server) nodeVMI(namespace, name string) *v1.VirtualMachineInstance {
	o, ok, err := s.vmis.GetStore().GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	vmi, ok := o.(*v1.VirtualMachineInstance)
	if !ok || !s.onNode(vmi) {
		return nil
	}
	return vmi
}

// onNode: the label selected the VMI; a status naming another node (a
// migration target's view) does not count.
func (s *Server) onNode(vmi *v1.VirtualMachineInstance) bool {
	return vmi.Status.NodeName == "" || vmi.Status.NodeName == s.cfg.NodeName
}

// phaseCounts keeps only kubevirt_vmi_phase_count of the VMI collector:
// kubevirt_vmi_info is the brain's, for every VMI of the cluster.
func phaseCounts(c prom.Collector) prom.Collector {
	return prom.CollectorFunc(func() []prom.Family {
		var out []prom.Family
		for _, f := range c.Collect() {
			if strings.HasSuffix(f.Name, "_phase_count") {
				out = append(out, f)
			}
		}
		return out
	})
}
