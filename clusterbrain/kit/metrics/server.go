package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// Server serves a registry on /metrics.
type Server struct {
	Addr     string
	Registry *Registry
	Log      *slog.Logger
	// Start, when set, runs before serving (to start informers).
	Start func(ctx context.Context)
}

// Name names the daemon role.
func (s *Server) Name() string { return "metrics" }

// Run serves until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	if s.Log == nil {
		s.Log = slog.Default()
	}
	if s.Start != nil {
		s.Start(ctx)
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

// WarnIfExposed logs a warning when addr accepts connections from beyond
// this host.
func WarnIfExposed(log *slog.Logger, addr net.Addr) {
	tcp, ok := addr.(*net.TCPAddr)
	if ok && tcp.IP.IsLoopback() {
		return
	}
	log.Warn("metrics are served without authentication beyond loopback", "addr", addr.String())
}
