package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/apis/client"
)

// Server serves a registry on /metrics.
type Server struct {
	Addr     string
	Registry *Registry
	Log      *slog.Logger
	// start runs before serving (informers).
	start func(ctx context.Context)
}

// NewBrainServer serves the default registry on addr with the VMI
// collectors (kubevirt_vmi_info, kubevirt_vmi_phase_count) over a VMI
// informer of all namespaces.
func NewBrainServer(addr string, virt *client.Set, log *slog.Logger) *Server {
	inf := virt.VMIs.Informer("", 10*time.Minute, nil)
	reg := Default()
	reg.Register(VMICollector(func() []*kubevirtv1.VirtualMachineInstance {
		var out []*kubevirtv1.VirtualMachineInstance
		for _, o := range inf.GetStore().List() {
			if vmi, ok := o.(*kubevirtv1.VirtualMachineInstance); ok {
				out = append(out, vmi)
			}
		}
		return out
	}))
	return &Server{Addr: addr, Registry: reg, Log: log, start: func(ctx context.Context) { go inf.Run(ctx.Done()) }}
}

// Name names the brain role.
func (s *Server) Name() string { return "metrics" }

// Run serves until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	if s.Log == nil {
		s.Log = slog.Default()
	}
	if s.start != nil {
		s.start(ctx)
	}
	ln, err := net.Listen("tcp", s.Addr)
	if err != nil {
		return fmt.Errorf("metrics listen %s: %w", s.Addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", s.Registry.Handler())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	s.Log.Info("metrics serving", "addr", ln.Addr().String())
	WarnIfExposed(s.Log, ln.Addr())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// DefaultBrainAddr is where the brain serves /metrics: loopback only. The
// endpoints carry no authentication (namespaces and names of every VM are
// in them); an operator who wants them scraped from elsewhere sets the
// address and puts an authenticating proxy or a network policy in front.
const DefaultBrainAddr = "127.0.0.1:8484"

// WarnIfExposed logs a warning when addr accepts connections from beyond
// this host.
func WarnIfExposed(log *slog.Logger, addr net.Addr) {
	tcp, ok := addr.(*net.TCPAddr)
	if ok && tcp.IP.IsLoopback() {
		return
	}
	log.Warn("metrics are served without authentication beyond loopback", "addr", addr.String())
}
