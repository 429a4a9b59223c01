// Package upload is the brain's upload role (cdi-apiserver's token API and
// cdi-uploadproxy): it serves UploadTokenRequest (upload.cdi.kubevirt.io/
// v1beta1) as an aggregated API, issuing short-lived tokens signed with an
// Ed25519 key kept in a Secret and bound to one PVC after a
// SubjectAccessReview; and it runs the upload proxy that virtctl
// image-upload talks to, which checks the token and streams the body over
// mutual TLS to the nodeagent holding the volume.
package upload

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
	"sync/atomic"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
)

// Config configures the role.
type Config struct {
	Kube kubernetes.Interface
	// Namespace is the brain's namespace: it holds the keys, the Service of
	// the aggregated API and the upload CA.
	Namespace string
	// APIAddr is where the aggregated API listens (default ":8445").
	APIAddr string
	// ProxyAddr is where the upload proxy listens (default ":8446").
	ProxyAddr string
	// AdvertiseIP is the address of the aggregated API published in its
	// EndpointSlice; empty means the listen host, or this host's first
	// global IPv4 address when that is unspecified (the API server refuses
	// loopback endpoints).
	AdvertiseIP string
	// TokenTTL is the lifetime of an upload token (default 5 minutes).
	TokenTTL time.Duration
	// ReadyWait is how long an upload waits for its target to be ready
	// (default 10s).
	ReadyWait time.Duration
	// TLSProfile is the CDI CR's TLS settings for the API and the proxy
	// (nil: TLS 1.2 and Go's suites).
	TLSProfile *tlsprofile.Live
	Log        *slog.Logger
}

func (c *Config) defaults() {
	if c.Namespace == "" {
		c.Namespace = "kubevirt-hyperconverged"
	}
	if c.APIAddr == "" {
		c.APIAddr = ":8445"
	}
	if c.ProxyAddr == "" {
		c.ProxyAddr = ":8446"
	}
	if c.TokenTTL == 0 {
		c.TokenTTL = 5 * time.Minute
	}
	if c.ReadyWait == 0 {
		c.ReadyWait = 10 * time.Second
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	if c.Kube == nil {
		return errors.New("upload: a Kube client is required")
	}
	if c.TokenTTL < time.Minute {
		return errors.New("upload: token ttl must be at least a minute")
	}
	return nil
}

// Server is the running role.
type Server struct {
	cfg  Config
	log  *slog.Logger
	kube kubernetes.Interface

	signer *Signer
	ca     *uploadtls.CA
	auth   atomic.Pointer[frontProxyAuth]
	// toNodes reaches a node's upload endpoint, verifying that the
	// server's certificate names that node (see toNode).
	toNodes  *http.Transport
	nodesMu  sync.Mutex
	perNode  map[string]*http.Client
	apiLn    net.Listener
	proxyLn  net.Listener
	apiCert  tls.Certificate
	proxyTLS tls.Certificate

	ready atomic.Bool
}

// New validates cfg and builds the role; Run starts it.
func New(cfg Config) (*Server, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Server{cfg: cfg, log: cfg.Log.With("role", "upload"), kube: cfg.Kube}, nil
}

// Name is the role's name.
func (s *Server) Name() string { return "upload" }

// APIAddr and ProxyAddr are the bound addresses once Run has started
// listening (tests use port 0); empty before.
func (s *Server) APIAddr() string   { return addrOf(s.apiLn) }
func (s *Server) ProxyAddr() string { return addrOf(s.proxyLn) }

// Ready reports whether both servers serve and the API is registered.
func (s *Server) Ready() bool { return s.ready.Load() }

// CA is the upload CA (the proxy's serving certificate chains to it).
func (s *Server) CA() *uploadtls.CA { return s.ca }

func addrOf(ln net.Listener) string {
	if ln == nil {
		return ""
	}
	return ln.Addr().String()
}

// Run sets up keys, certificates and the API registration, then serves
// until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	if err := s.setup(ctx); err != nil {
		return err
	}
	defer s.apiLn.Close()
	defer s.proxyLn.Close()
	go s.refreshAuth(ctx)

	api := &http.Server{Handler: s.apiHandler(), ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute,
		TLSConfig: s.cfg.TLSProfile.Server(&tls.Config{MinVersion: tls.VersionTLS12, GetConfigForClient: s.apiTLSConfig})}
	proxy := &http.Server{Handler: s.proxyHandler(), ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute,
		TLSConfig: s.cfg.TLSProfile.Server(&tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{s.proxyTLS}})}
	errc := make(chan error, 2)
	go func() { errc <- api.ServeTLS(s.apiLn, "", "") }()
	go func() { errc <- proxy.ServeTLS(s.proxyLn, "", "") }()
	if err := s.register(ctx); err != nil {
		_ = api.Close()
		_ = proxy.Close()
		return err
	}
	s.ready.Store(true)
	s.log.Info("serving", "api", s.APIAddr(), "proxy", s.ProxyAddr())
	go s.keepProxyURL(ctx)
	go aggregated.KeepRegistered(ctx, s.log, "endpointslice "+s.cfg.Namespace+"/"+apiService,
		aggregated.SliceAnswers(s.cfg.Kube, s.cfg.Namespace, apiService), s.register)
	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
	}
	s.ready.Store(false)
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = api.Shutdown(shut)
	_ = proxy.Shutdown(shut)
	if err != nil && !errors.Is(err, http.ErrServerClosed) && ctx.Err() == nil {
		return fmt.Errorf("upload: %w", err)
	}
	return nil
}

func (s *Server) setup(ctx context.Context) error {
	var err error
	if s.ca, err = uploadtls.EnsureCA(ctx, s.kube, s.cfg.Namespace); err != nil {
		return err
	}
	key, err := loadSigningKey(ctx, s.kube, s.cfg.Namespace)
	if err != nil {
		return err
	}
	s.signer = NewSigner(key, s.cfg.TokenTTL)
	if err := s.loadAuth(ctx); err != nil {
		return err
	}
	if s.apiLn, err = net.Listen("tcp", s.cfg.APIAddr); err != nil {
		return fmt.Errorf("upload api: %w", err)
	}
	if s.proxyLn, err = net.Listen("tcp", s.cfg.ProxyAddr); err != nil {
		s.apiLn.Close()
		return fmt.Errorf("upload proxy: %w", err)
	}
	fail := func(err error) error {
		s.apiLn.Close()
		s.proxyLn.Close()
		return err
	}
	ip, err := s.advertiseIP()
	if err != nil {
		return fail(err)
	}
	svcDNS := []string{apiService + "." + s.cfg.Namespace + ".svc", apiService + "." + s.cfg.Namespace + ".svc.cluster.local"}
	if s.apiCert, err = s.ca.Issue("nodevirt-upload-api", svcDNS, []net.IP{ip}, false); err != nil {
		return fail(err)
	}
	if s.proxyTLS, err = s.ca.Issue("nodevirt-upload-proxy-server", []string{"nodevirt-upload-proxy", "localhost"},
		[]net.IP{ip, net.IPv4(127, 0, 0, 1)}, false); err != nil {
		return fail(err)
	}
	clientCert, err := s.ca.Issue(identity.UploadProxyClientName, nil, nil, true)
	if err != nil {
		return fail(err)
	}
	s.toNodes = &http.Transport{
		TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{clientCert},
			RootCAs: s.ca.Pool()},
		DialContext:           (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 0, // a synchronous upload answers when the import ends
		MaxIdleConnsPerHost:   4,
	}
	s.perNode = map[string]*http.Client{}
	return nil
}

// toNode is the client for node's upload endpoint: it accepts only a
// certificate naming node, so a node that published (or hijacked) another
// node's endpoint receives no upload meant for that node. (Every node
// certificate also carries identity.UploadServerName, which says only "a
// node".)
func (s *Server) toNode(node string) *http.Client {
	s.nodesMu.Lock()
	defer s.nodesMu.Unlock()
	hc := s.perNode[node]
	if hc == nil {
		tr := s.toNodes.Clone()
		tr.TLSClientConfig.ServerName = node
		hc = &http.Client{Transport: tr}
		s.perNode[node] = hc
	}
	return hc
}

func (s *Server) advertiseIP() (net.IP, error) {
	if s.cfg.AdvertiseIP != "" {
		ip := net.ParseIP(s.cfg.AdvertiseIP)
		if ip == nil {
			return nil, fmt.Errorf("upload: advertise ip %q is not an ip", s.cfg.AdvertiseIP)
		}
		return ip, nil
	}
	if tcp, ok := s.apiLn.Addr().(*net.TCPAddr); ok && !tcp.IP.IsUnspecified() && !tcp.IP.IsLoopback() {
		return tcp.IP, nil
	}
	return uploadtls.HostIP()
}

func (s *Server) apiPort() int32 {
	_, port, _ := net.SplitHostPort(s.apiLn.Addr().String())
	n, _ := strconv.Atoi(port)
	return int32(n)
}
