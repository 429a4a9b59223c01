// Package pluginreg registers the node's hostpath CSI driver with kubelet,
// as node-driver-registrar does for a CSI driver in its own pod: it serves
// kubelet's plugin registration API (k8s.io/kubelet pluginregistration/v1)
// on a socket in kubelet's plugin registry directory. Kubelet's plugin
// watcher finds the socket, asks GetInfo for the driver's name, CSI
// endpoint and versions, calls the driver's NodeGetInfo, records the node in
// the CSINode object and the topology label on the Node, and reports the
// result with NotifyRegistrationStatus. Kubelet then mounts the driver's
// volumes into pods too. Removing the socket (on shutdown) unregisters.
//
// On a host without kubelet (the registry directory is missing) the role
// does nothing: the node agent alone uses the driver.
package pluginreg

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// DefaultDir is kubelet's plugin registry directory with its default root
// directory.
const DefaultDir = "/var/lib/kubelet/plugins_registry"

// Config says what to register.
type Config struct {
	// Dir is kubelet's plugin registry directory (DefaultDir when empty).
	Dir string
	// DriverName is the CSI driver's name (CSIDriver object, StorageClass
	// provisioner).
	DriverName string
	// Endpoint is the driver's CSI socket as kubelet reaches it (a path on
	// the host).
	Endpoint string
	// Versions are the CSI versions served (default 1.0.0).
	Versions []string
	Log      *slog.Logger
}

func (c *Config) defaults() {
	if c.Dir == "" {
		c.Dir = DefaultDir
	}
	if len(c.Versions) == 0 {
		c.Versions = []string{"1.0.0"}
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	if c.DriverName == "" {
		return errors.New("plugin registration: driver name is required")
	}
	if !filepath.IsAbs(c.Endpoint) {
		return fmt.Errorf("plugin registration: endpoint %q must be an absolute socket path", c.Endpoint)
	}
	return nil
}

// Registrar serves the registration socket; it is a node agent role.
type Registrar struct {
	registerapi.UnimplementedRegistrationServer
	cfg Config

	mu         sync.Mutex
	registered bool
	lastError  string
}

// New validates cfg.
func New(cfg Config) (*Registrar, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Registrar{cfg: cfg}, nil
}

// Name implements the node agent's Role.
func (r *Registrar) Name() string { return "kubelet-plugin-registration" }

// Socket is the registration socket's path.
func (r *Registrar) Socket() string {
	return filepath.Join(r.cfg.Dir, r.cfg.DriverName+"-reg.sock")
}

// Registered reports kubelet's last answer: whether it registered the
// driver, and its error if it did not.
func (r *Registrar) Registered() (bool, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.registered, r.lastError
}

// Run serves the socket until ctx ends, then removes it.
func (r *Registrar) Run(ctx context.Context) error {
	log := r.cfg.Log.With("driver", r.cfg.DriverName, "dir", r.cfg.Dir)
	if st, err := os.Stat(r.cfg.Dir); err != nil || !st.IsDir() {
		log.Info("no kubelet plugin registry here: the driver serves the node agent only")
		<-ctx.Done()
		return nil
	}
	sock := r.Socket()
	// A socket left by an earlier run: kubelet treats a new socket file as
	// a new registration.
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale %s: %w", sock, err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("listen %s: %w", sock, err)
	}
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, r)
	log.Info("serving kubelet plugin registration", "socket", sock, "endpoint", r.cfg.Endpoint)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case <-ctx.Done():
		srv.Stop()
		<-errc
		if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove %s: %w", sock, err)
		}
		return nil
	case err := <-errc:
		return fmt.Errorf("serve %s: %w", sock, err)
	}
}

// GetInfo tells kubelet which plugin this is and where its CSI endpoint is.
func (r *Registrar) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{Type: registerapi.CSIPlugin, Name: r.cfg.DriverName, Endpoint: r.cfg.Endpoint,
		SupportedVersions: r.cfg.Versions}, nil
}

// NotifyRegistrationStatus receives kubelet's verdict.
func (r *Registrar) NotifyRegistrationStatus(_ context.Context, s *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	r.mu.Lock()
	r.registered, r.lastError = s.PluginRegistered, s.Error
	r.mu.Unlock()
	if s.PluginRegistered {
		r.cfg.Log.Info("registered with kubelet", "driver", r.cfg.DriverName)
	} else {
		r.cfg.Log.Error("kubelet refused the driver", "driver", r.cfg.DriverName, "err", s.Error)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

var _ registerapi.RegistrationServer = (*Registrar)(nil)
