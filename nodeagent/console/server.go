// Package console serves the serial consoles, VNC displays and power
// controls of a node's VMs to the cluster brain, over HTTPS with mutual TLS:
// only a client whose certificate chains to the configured CA (and, when
// Config.AllowedClients is set, carries one of those names) gets past the
// handshake. The brain turns KubeVirt's subresources (virtctl console, vnc,
// pause, unpause, softreboot, ...) into these calls.
//
// # Protocol
//
// Streams:
//
//	GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/console   serial console (ttyS0)
//	GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/vnc       RFB (VNC) display
//
// A stream request upgrades the connection in one of two ways:
//
//   - raw: request headers "Connection: Upgrade" and "Upgrade: nodevirt-stream".
//     The answer is "101 Switching Protocols" with the same Upgrade header;
//     from then on the TLS connection carries the console's (or VNC's)
//     bytes in both directions, unframed. Client.Console and Client.VNC
//     do this.
//   - WebSocket (RFC 6455, "Upgrade: websocket"): every binary (or text)
//     message carries bytes; the server sends binary messages. The
//     subprotocol plain.kubevirt.io is accepted, so the brain can hand
//     virtctl's WebSocket through a reverse proxy unchanged.
//
// A second stream of the same kind for the same VMI ends the first (its
// connection is closed), as with KubeVirt's console. Closing a stream leaves
// the guest running.
//
// Port forwarding, when the Backend implements PortForwardBackend (one
// stream per forwarded connection, any number side by side):
//
//	GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/portforward/{port}[/{protocol}]
//
// carries the bytes of a TCP connection (protocol tcp, the default) or the
// datagrams of a UDP socket (udp) to the port of the guest's pod network
// address, as virt-api dials a VMI's pod address for KubeVirt.
//
// Controls, each a PUT with an empty body, answered 200 when done (202 for
// shutdown, which only starts the graceful shutdown):
//
//	PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/pause
//	PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/unpause
//	PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/softreboot   ACPI reboot request
//	PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/reset        hard reset
//	PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/shutdown     ACPI power button, destroyed after the grace period
//
// Guest file system freeze and thaw (online snapshots and the freeze
// subresource), when the Backend implements FreezeBackend, each a PUT
// answered 200:
//
//	PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/freeze
//	    (optional body: KubeVirt's FreezeUnfreezeTimeout; without one the
//	    guest is thawed after DefaultUnfreezeTimeout)
//	PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/unfreeze
//
// Guest agent information, when the Backend implements GuestAgentBackend,
// each a GET answered 200 with KubeVirt's JSON type:
//
//	GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/guestosinfo     VirtualMachineInstanceGuestAgentInfo
//	GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/userlist        VirtualMachineInstanceGuestOSUserList
//	GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/filesystemlist  VirtualMachineInstanceFileSystemList
//
// A screenshot of the display, when the Backend implements
// ScreenshotBackend, answered 200 with image/png:
//
//	GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/vnc/screenshot
//
// Errors are plain-text bodies with 404 (the VMI is not running on this
// node's books: ErrNotFound), 409 (the VMI has no running domain:
// ErrNotRunning; or no connected guest agent: ErrNoGuestAgent), 501 (the
// backend has no guest agent support), 403 (client certificate name not allowed), 400 (bad
// request) or 500.
package console

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// Backend runs the VMIs; the virt-handler role implements it. Errors wrap
// ErrNotFound or ErrNotRunning where they apply.
type Backend interface {
	// Console opens the serial console of a running VMI; Close ends the
	// session, not the guest. Opening another takes the console over.
	Console(ctx context.Context, namespace, name string) (io.ReadWriteCloser, error)
	// VNC connects to the VNC server of a running VMI.
	VNC(ctx context.Context, namespace, name string) (io.ReadWriteCloser, error)
	Pause(ctx context.Context, namespace, name string) error
	Unpause(ctx context.Context, namespace, name string) error
	SoftReboot(ctx context.Context, namespace, name string) error
	Reset(ctx context.Context, namespace, name string) error
	// Shutdown starts a graceful shutdown and returns.
	Shutdown(ctx context.Context, namespace, name string) error
}

// GuestAgentBackend reads a running VMI's QEMU guest agent; the
// virt-handler role implements it. Errors wrap ErrNotFound, ErrNotRunning
// or ErrNoGuestAgent where they apply. A Backend without it answers the
// guest agent GETs 501.
type GuestAgentBackend interface {
	GuestOSInfo(ctx context.Context, namespace, name string) (*kubevirtv1.VirtualMachineInstanceGuestAgentInfo, error)
	UserList(ctx context.Context, namespace, name string) (*kubevirtv1.VirtualMachineInstanceGuestOSUserList, error)
	FileSystemList(ctx context.Context, namespace, name string) (*kubevirtv1.VirtualMachineInstanceFileSystemList, error)
}

// FreezeBackend freezes and thaws a running VMI's file systems through its
// guest agent. A Backend without it answers freeze and unfreeze 501.
type FreezeBackend interface {
	// Freeze freezes the guest; the backend thaws it by itself after
	// unfreezeTimeout (never when 0).
	Freeze(ctx context.Context, namespace, name string, unfreezeTimeout time.Duration) error
	Unfreeze(ctx context.Context, namespace, name string) error
}

// DefaultUnfreezeTimeout is how long a freeze without a body (an online
// snapshot's) lasts unless thawed, as KubeVirt's snapshot controller asks.
const DefaultUnfreezeTimeout = 5 * time.Minute

// unfreezeTimeout reads a freeze's optional body, KubeVirt's
// FreezeUnfreezeTimeout; without one the default applies.
func unfreezeTimeout(r *http.Request) (time.Duration, error) {
	data, err := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	if err != nil {
		return 0, httperr.BadRequest("read freeze body: %v", err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return DefaultUnfreezeTimeout, nil
	}
	var body kubevirtv1.FreezeUnfreezeTimeout
	if err := json.Unmarshal(data, &body); err != nil {
		return 0, httperr.BadRequest("freeze body: %v", err)
	}
	if body.UnfreezeTimeout == nil || body.UnfreezeTimeout.Duration < 0 {
		return 0, httperr.BadRequest("freeze body: unfreezeTimeout must be set and not negative")
	}
	return body.UnfreezeTimeout.Duration, nil
}

// The errors a Backend returns (wrapped or not) for the answers they name;
// any other error answers 500.
var (
	// ErrNoGuestAgent: the VMI's guest agent is not connected (409).
	ErrNoGuestAgent = httperr.Conflict("vmi does not have guest agent connected")
	// ErrNotFound: no such VMI on this node (404).
	ErrNotFound = httperr.NotFound("vmi not found on this node")
	// ErrNotRunning: the VMI has no running domain (409).
	ErrNotRunning = httperr.Conflict("vmi is not running")
)

// Config configures a Server. The TLS material is either files or TLS.
type Config struct {
	// Addr is the listen address, e.g. ":8186" or "127.0.0.1:0"; required.
	Addr string
	// CertFile and KeyFile are the server's certificate and key (PEM).
	CertFile, KeyFile string
	// ClientCAFile is the PEM bundle client certificates must chain to.
	ClientCAFile string
	// AllowedClients, when not empty, are the only client certificate
	// subject common names let in.
	AllowedClients []string
	// TLS, when set, replaces the files; it must require and verify client
	// certificates.
	TLS *tls.Config
	// TLSProfile is the KubeVirt CR's TLS settings (minimum version and
	// suites), applied at every handshake; nil: TLS 1.2 and Go's suites.
	TLSProfile *tlsprofile.Live
	// Log; slog.Default() when nil.
	Log *slog.Logger
}

func (c *Config) tlsConfig() (*tls.Config, error) {
	cfg, err := c.baseTLS()
	if err != nil {
		return nil, err
	}
	return c.TLSProfile.Server(cfg), nil
}

func (c *Config) baseTLS() (*tls.Config, error) {
	if c.TLS != nil {
		if c.TLS.ClientAuth != tls.RequireAndVerifyClientCert {
			return nil, errors.New("console: tls config must require and verify client certificates")
		}
		return c.TLS.Clone(), nil
	}
	if c.CertFile == "" || c.KeyFile == "" || c.ClientCAFile == "" {
		return nil, errors.New("console: cert file, key file and client CA file are required")
	}
	cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("console: server certificate: %w", err)
	}
	pem, err := os.ReadFile(c.ClientCAFile)
	if err != nil {
		return nil, fmt.Errorf("console: client CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("console: client CA %s holds no certificate", c.ClientCAFile)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		MinVersion:   tls.VersionTLS12,
	}, nil
}

// Server is the console/VNC/control server.
type Server struct {
	cfg     Config
	log     *slog.Logger
	backend Backend
	ln      net.Listener
	srv     *http.Server

	mu       sync.Mutex
	sessions map[string]io.Closer
	streamID atomic.Uint64 // tells shared streams apart
}

// New validates cfg and listens on cfg.Addr; Run serves.
func New(cfg Config, backend Backend) (*Server, error) {
	if cfg.Addr == "" {
		return nil, errors.New("console: listen address is required")
	}
	if backend == nil {
		return nil, errors.New("console: backend is required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	tc, err := cfg.tlsConfig()
	if err != nil {
		return nil, err
	}
	tc.NextProtos = []string{"http/1.1"} // upgrades need HTTP/1.1
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	s := &Server{cfg: cfg, log: cfg.Log.With("server", "console"), backend: backend, sessions: map[string]io.Closer{}}
	s.ln = tls.NewListener(ln, tc)
	mux := http.NewServeMux()
	mux.Handle("GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/console", s.stream("console", false, exclusive(backend.Console)))
	mux.Handle("GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/vnc", s.stream("vnc", false, exclusive(backend.VNC)))
	mux.Handle("GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/vnc/screenshot", httperr.TextHandler(s.screenshot))
	pf := s.stream("portforward", true, s.portForward)
	mux.Handle("GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/portforward/{port}", pf)
	mux.Handle("GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/portforward/{port}/{protocol}", pf)
	mux.Handle("PUT /v1/namespaces/{namespace}/virtualmachineinstances/{name}/{action}", httperr.TextHandler(s.control))
	mux.Handle("GET /v1/namespaces/{namespace}/virtualmachineinstances/{name}/{info}", httperr.TextHandler(s.guestAgent))
	s.srv = &http.Server{
		Handler:           s.authorize(mux),
		ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
		TLSNextProto: map[string]func(*http.Server, *tls.Conn, http.Handler){},
		ErrorLog:     slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Run serves until ctx ends, then closes the listener and every stream.
func (s *Server) Run(ctx context.Context) error {
	errc := make(chan error, 1)
	go func() { errc <- s.srv.Serve(s.ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	s.srv.Close()
	s.mu.Lock()
	for _, c := range s.sessions {
		c.Close()
	}
	s.mu.Unlock()
	<-errc
	return nil
}

// authorize checks the client certificate's names against AllowedClients.
func (s *Server) authorize(next http.Handler) http.Handler {
	return httperr.TextHandler(func(w http.ResponseWriter, r *http.Request) error {
		if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
			return httperr.Unauthorized("client certificate required")
		}
		if len(s.cfg.AllowedClients) > 0 {
			// The subject names a client; its DNS names are server
			// identities (every node certificate carries the shared ones)
			// and grant nothing here.
			cn := r.TLS.PeerCertificates[0].Subject.CommonName
			if !slices.Contains(s.cfg.AllowedClients, cn) {
				s.log.Warn("client not allowed", "client", cn, "remote", r.RemoteAddr)
				return httperr.Forbidden("client not allowed")
			}
		}
		next.ServeHTTP(w, r)
		return nil
	})
}

func (s *Server) control(w http.ResponseWriter, r *http.Request) error {
	ns, name, action := r.PathValue("namespace"), r.PathValue("name"), r.PathValue("action")
	ops := map[string]func(context.Context, string, string) error{
		"pause": s.backend.Pause, "unpause": s.backend.Unpause, "softreboot": s.backend.SoftReboot,
		"reset": s.backend.Reset, "shutdown": s.backend.Shutdown,
	}
	if fb, ok := s.backend.(FreezeBackend); ok {
		ops["freeze"] = func(ctx context.Context, ns, name string) error {
			d, err := unfreezeTimeout(r)
			if err != nil {
				return err
			}
			return fb.Freeze(ctx, ns, name, d)
		}
		ops["unfreeze"] = fb.Unfreeze
	} else if action == "freeze" || action == "unfreeze" {
		return httperr.NotImplemented("guest freeze is not served by this node")
	}
	op, ok := ops[action]
	if !ok {
		return httperr.NotFound("unknown action %q", action)
	}
	log := s.log.With("vmi", ns+"/"+name, "action", action)
	if err := op(r.Context(), ns, name); err != nil {
		log.Info("control failed", "err", err)
		return err
	}
	log.Info("control done")
	if action == "shutdown" {
		w.WriteHeader(http.StatusAccepted)
		return nil
	}
	w.WriteHeader(http.StatusOK)
	return nil
}

// guestAgent answers the guest agent GETs.
func (s *Server) guestAgent(w http.ResponseWriter, r *http.Request) error {
	ns, name, what := r.PathValue("namespace"), r.PathValue("name"), r.PathValue("info")
	ga, ok := s.backend.(GuestAgentBackend)
	if !ok {
		return httperr.NotImplemented("guest agent information is not served by this node")
	}
	var (
		answer any
		err    error
	)
	switch what {
	case "guestosinfo":
		answer, err = ga.GuestOSInfo(r.Context(), ns, name)
	case "userlist":
		answer, err = ga.UserList(r.Context(), ns, name)
	case "filesystemlist":
		answer, err = ga.FileSystemList(r.Context(), ns, name)
	default:
		return httperr.NotFound("unknown resource %q", what)
	}
	if err != nil {
		s.log.Info("guest agent call failed", "vmi", ns+"/"+name, "info", what, "err", err)
		return err
	}
	body, err := json.Marshal(answer)
	if err != nil {
		return fmt.Errorf("encode %s: %w", what, err)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(body)
	return nil
}
