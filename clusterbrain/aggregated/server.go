package aggregated

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// Config configures a Server.
type Config struct {
	Kube    kubernetes.Interface
	Dynamic dynamic.Interface
	// Registration names the API; its IP and Port default to the listener's
	// (IP: the listen IP, or the host's first global IPv4 when listening on
	// all addresses). Loopback cannot be used: kube-apiserver refuses
	// loopback addresses in EndpointSlices.
	Registration Registration
	// Addr is the listen address (port 0 picks a free port), e.g. ":8443".
	Addr string
	// Handler serves requests; authenticated ones carry their User (see
	// UserFrom).
	Handler http.Handler
	// Public tells which requests besides the registration's discovery
	// and health (Registration.Discovery) need no authenticated user. Nil:
	// every other request must come through the aggregator.
	Public func(r *http.Request) bool
	// CASecret names the brain CA Secret shared with the other servers
	// (default certs' nodevirt-brain-ca); the serving certificate is kept in
	// Secret "<service>-cert" of the registration namespace.
	CASecret string
	// Durations of the CA and serving certificate (default HCO's).
	Durations func(context.Context) certs.Durations
	// TLSProfile is the KubeVirt CR's TLS settings, applied at every
	// handshake (nil: TLS 1.2 and Go's suites).
	TLSProfile *tlsprofile.Live
	Log        *slog.Logger
}

// Server is an aggregated API server.
type Server struct {
	cfg   Config
	rh    *RequestHeader
	ready chan struct{}
	once  sync.Once
	addr  net.Addr
}

// NewServer validates cfg.
func NewServer(cfg Config) (*Server, error) {
	r := cfg.Registration
	if cfg.Kube == nil || cfg.Dynamic == nil || cfg.Handler == nil {
		return nil, errors.New("aggregated: kube and dynamic clients and a handler are required")
	}
	if r.Group == "" || len(r.Versions) == 0 || r.Namespace == "" || r.Service == "" {
		return nil, errors.New("aggregated: registration needs group, versions, namespace and service")
	}
	if cfg.Addr == "" {
		return nil, errors.New("aggregated: listen address is required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Server{cfg: cfg, ready: make(chan struct{})}, nil
}

// Ready is closed once the server listens and its API is registered.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// Addr is the bound listen address (valid after Ready).
func (s *Server) Addr() net.Addr { return s.addr }

// Registration returns the registration in effect (valid after Ready).
func (s *Server) Registration() Registration { return s.cfg.Registration }

// Run listens, keeps the serving certificate and the registration current
// and serves until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	log := s.cfg.Log.With("group", s.cfg.Registration.Group)
	rh, err := LoadRequestHeader(ctx, s.cfg.Kube)
	if err != nil {
		return err
	}
	s.rh = rh
	go rh.Run(ctx, s.cfg.Kube, time.Minute)

	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", s.cfg.Addr, err)
	}
	defer ln.Close()
	s.addr = ln.Addr()
	reg := &s.cfg.Registration
	if err := reg.Resolve(ln.Addr()); err != nil {
		return fmt.Errorf("aggregated api: %w", err)
	}
	hosts := reg.Hosts()
	registered := make(chan struct{})
	var regOnce sync.Once
	cm, err := certs.New(certs.Config{
		Kube: s.cfg.Kube, Namespace: reg.Namespace, CASecret: s.cfg.CASecret, ServerSecret: reg.Service + "-cert",
		Hosts: hosts, Durations: s.cfg.Durations, Log: s.cfg.Log,
		PublishBundle: func(ctx context.Context, bundle []byte) error {
			if err := Register(ctx, s.cfg.Kube, s.cfg.Dynamic, *reg, bundle); err != nil {
				return err
			}
			regOnce.Do(func() { close(registered) })
			return nil
		},
		Propagation: 2 * time.Second,
	})
	if err != nil {
		return err
	}
	go func() { _ = cm.Run(ctx) }()
	select {
	case <-ctx.Done():
		return nil
	case <-registered:
	}
	for {
		if _, err := cm.GetCertificate(nil); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(50 * time.Millisecond):
		}
	}
	srv := &http.Server{
		Handler:           s.authenticate(s.cfg.Handler),
		ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute,
		TLSConfig: s.cfg.TLSProfile.Server(&tls.Config{
			GetCertificate: cm.GetCertificate,
			ClientAuth:     tls.RequestClientCert,
			MinVersion:     tls.VersionTLS12,
		}),
		ErrorLog: slog.NewLogLogger(s.cfg.Log.Handler(), slog.LevelDebug),
	}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	go KeepRegistered(ctx, log, "endpointslice "+reg.Namespace+"/"+reg.Service, SliceAnswers(s.cfg.Kube, reg.Namespace, reg.Service),
		func(ctx context.Context) error { return Register(ctx, s.cfg.Kube, s.cfg.Dynamic, *reg, cm.CABundle()) })
	log.Info("aggregated api serving", "addr", s.addr.String(), "endpoint", net.JoinHostPort(reg.IP.String(), strconv.Itoa(reg.Port)))
	s.once.Do(func() { close(s.ready) })
	if err := srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// authenticate lets through public requests and those the aggregator
// proxied, with their user in the context.
func (s *Server) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, err := s.rh.Authenticate(r)
		if err == nil {
			next.ServeHTTP(w, r.WithContext(WithUser(r.Context(), u)))
			return
		}
		if s.cfg.Registration.Discovery(r) || s.cfg.Public != nil && s.cfg.Public(r) {
			next.ServeHTTP(w, r)
			return
		}
		s.cfg.Log.Debug("refused unauthenticated request", "path", r.URL.Path, "err", err)
		httperr.WriteStatus(w, apierrors.NewUnauthorized(err.Error()))
	})
}

// hostIP is the first global unicast IPv4 address of this host.
func hostIP() (net.IP, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
			return n.IP, nil
		}
	}
	return nil, errors.New("no global unicast ipv4 address to advertise")
}
