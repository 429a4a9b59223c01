// Package csi is nodevirt's hostpath CSI driver: node-local storage pools
// served through the CSI Identity, Controller and Node services on a unix
// socket, and callable in-process by the nodeagent.
//
// Every volume is a sized image file in a pool, so its requested size is
// both reported and enforced: a filesystem volume is a sparse image holding
// an ext4 filesystem, loop-mounted on the node (a VM's disk is disk.img
// inside it, as KubeVirt lays out filesystem PVCs); a block volume is the
// image attached as a loop device. The driver's records live in a JSON state
// file per pool, replaced atomically, so a restarted driver loses nothing.
package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
)

// Names users already know.
const (
	// DriverName is the CSI driver name of the hostpath provisioner.
	DriverName = "kubevirt.io.hostpath-provisioner"
	// TopologyKey is the topology segment holding the node name.
	TopologyKey = "topology.hostpath.csi/node"
	// ParamStoragePool is the StorageClass parameter that picks a pool.
	ParamStoragePool = "storagePool"
	// DiskImageName is the VM disk file inside a filesystem volume.
	DiskImageName = "disk.img"
)

// Defaults applied by Config.
const (
	DefaultStateRoot   = "/var/lib/nodevirt/csi"
	DefaultEndpoint    = "/var/lib/kubelet/plugins/kubevirt.io.hostpath-provisioner/csi.sock"
	DefaultPoolName    = "default"
	defaultVolumeBytes = 1 << 30
)

// PoolConfig is one storage pool: a directory on the node.
type PoolConfig struct {
	// Name identifies the pool in the StorageClass parameter storagePool.
	Name string
	// Path is the pool's absolute directory; created if missing.
	Path string
}

// Config configures a Driver. Zero values are defaulted by New.
type Config struct {
	// DriverName defaults to DriverName.
	DriverName string
	// Version is reported as the vendor version.
	Version string
	// NodeID is this node's name; required.
	NodeID string
	// Endpoint is the unix socket Run serves on (a path or unix:// URL);
	// defaults to DefaultEndpoint.
	Endpoint string
	// StateRoot holds the default pool when Pools is empty; defaults to
	// DefaultStateRoot.
	StateRoot string
	// Pools lists the node's storage pools; defaults to one pool
	// DefaultPoolName under StateRoot.
	Pools []PoolConfig
	// DefaultPool is used when a request names no pool; defaults to the
	// first pool.
	DefaultPool string
	// MaxVolumesPerNode is reported by NodeGetInfo; 0 means no limit.
	MaxVolumesPerNode int64
	// Logger receives the call log; defaults to slog.Default().
	Logger *slog.Logger
	// ObserveCall, when set, is told of every finished gRPC call: its
	// method, status code and duration (the nodeagent makes a latency
	// histogram of it).
	ObserveCall func(method string, code codes.Code, took time.Duration)
	// SharePools makes each pool's volumes directory a mount point of its
	// own with shared propagation (as kubelet does for its root), so a
	// volume mounted after a guest started reaches QEMU's private mount
	// namespace. The node agent sets it; the mount stays when the driver
	// stops (running guests need it).
	SharePools bool
}

func (c *Config) defaults() {
	if c.DriverName == "" {
		c.DriverName = DriverName
	}
	if c.Version == "" {
		c.Version = "0.1.0"
	}
	if c.Endpoint == "" {
		c.Endpoint = DefaultEndpoint
	}
	if c.StateRoot == "" {
		c.StateRoot = DefaultStateRoot
	}
	if len(c.Pools) == 0 {
		c.Pools = []PoolConfig{{Name: DefaultPoolName, Path: filepath.Join(c.StateRoot, "pools", DefaultPoolName)}}
	}
	if c.DefaultPool == "" {
		c.DefaultPool = c.Pools[0].Name
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *Config) validate() error {
	if c.NodeID == "" {
		return errors.New("node id is required")
	}
	if !filepath.IsAbs(c.StateRoot) {
		return fmt.Errorf("state root %q is not absolute", c.StateRoot)
	}
	if c.MaxVolumesPerNode < 0 {
		return fmt.Errorf("max volumes per node %d is negative", c.MaxVolumesPerNode)
	}
	seenName, seenPath := map[string]bool{}, map[string]bool{}
	for _, p := range c.Pools {
		if !validID(p.Name) {
			return fmt.Errorf("pool name %q is not a valid name", p.Name)
		}
		if !filepath.IsAbs(p.Path) {
			return fmt.Errorf("pool %s: path %q is not absolute", p.Name, p.Path)
		}
		clean := filepath.Clean(p.Path)
		if seenName[p.Name] || seenPath[clean] {
			return fmt.Errorf("pool %s (%s) is listed twice", p.Name, p.Path)
		}
		seenName[p.Name], seenPath[clean] = true, true
	}
	if !seenName[c.DefaultPool] {
		return fmt.Errorf("default pool %q is not among the pools", c.DefaultPool)
	}
	return nil
}

// socketPath turns Endpoint into a filesystem path.
func (c *Config) socketPath() (string, error) {
	ep := c.Endpoint
	switch {
	case strings.HasPrefix(ep, "unix://"):
		ep = strings.TrimPrefix(ep, "unix://")
	case strings.HasPrefix(ep, "unix:"):
		ep = strings.TrimPrefix(ep, "unix:")
	case strings.Contains(ep, "://"):
		return "", fmt.Errorf("endpoint %q is not a unix socket", c.Endpoint)
	}
	if !filepath.IsAbs(ep) {
		return "", fmt.Errorf("endpoint %q is not an absolute path", c.Endpoint)
	}
	return ep, nil
}

// Driver serves the CSI Identity, Controller and Node services for this
// node's pools. Its methods may be called in-process as well as over gRPC.
type Driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer

	cfg Config
	log *slog.Logger
	// poolsMu guards pools, which AddPool and RemovePool change while the
	// driver serves.
	poolsMu sync.RWMutex
	pools   map[string]*pool
	// poolUse is held for reading by every CreateVolume and for writing by
	// RemovePool, so a pool never goes away under a volume being made.
	poolUse sync.RWMutex
	locks   keyedLocks
	// onlineResize tells whether mounted filesystems can be grown.
	onlineResize bool

	mu            sync.Mutex // guards the maps below and the state files
	volumes       map[string]*volume
	volumeNames   map[string]string // CSI name → volume ID
	snapshots     map[string]*snapshot
	snapshotNames map[string]string // CSI name → snapshot ID
}

var (
	_ csi.IdentityServer   = (*Driver)(nil)
	_ csi.ControllerServer = (*Driver)(nil)
	_ csi.NodeServer       = (*Driver)(nil)
)

// New validates cfg, loads every pool's state and brings the recorded
// volumes back (filesystems mounted, block devices attached). Leftovers of
// operations interrupted by a crash are removed.
func New(cfg Config) (*Driver, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("csi driver config: %w", err)
	}
	if _, err := cfg.socketPath(); err != nil {
		return nil, fmt.Errorf("csi driver config: %w", err)
	}
	d := &Driver{
		cfg:           cfg,
		log:           cfg.Logger.With("driver", cfg.DriverName, "node", cfg.NodeID),
		pools:         map[string]*pool{},
		volumes:       map[string]*volume{},
		volumeNames:   map[string]string{},
		snapshots:     map[string]*snapshot{},
		snapshotNames: map[string]string{},
		onlineResize:  canResizeOnline(),
	}
	for _, pc := range cfg.Pools {
		p, err := openPool(pc, cfg.SharePools)
		if err != nil {
			return nil, err
		}
		d.pools[p.name] = p
	}
	if err := d.load(); err != nil {
		return nil, err
	}
	return d, nil
}

// Run serves the driver on its unix socket until ctx is done.
func (d *Driver) Run(ctx context.Context) error {
	sock, _ := d.cfg.socketPath() // validated in New
	if err := os.MkdirAll(filepath.Dir(sock), 0o750); err != nil {
		return fmt.Errorf("create socket directory: %w", err)
	}
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", sock, err)
	}
	defer os.Remove(sock)

	srv := grpc.NewServer(grpc.UnaryInterceptor(d.logCalls))
	csi.RegisterIdentityServer(srv, d)
	csi.RegisterControllerServer(srv, d)
	csi.RegisterNodeServer(srv, d)

	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		srv.GracefulStop()
	}()
	d.log.Info("serving csi", "endpoint", sock, "pools", len(d.poolList()))
	err = srv.Serve(lis)
	<-stopped
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve csi: %w", err)
	}
	return nil
}

// NodeID is the node name this driver serves.
func (d *Driver) NodeID() string { return d.cfg.NodeID }

// Pools lists the served pool names, the default first, the others by
// name.
func (d *Driver) Pools() []string {
	out := []string{d.cfg.DefaultPool}
	for _, p := range d.poolList() {
		if p.name != d.cfg.DefaultPool {
			out = append(out, p.name)
		}
	}
	return out
}

// PoolPath returns the directory of a served pool.
func (d *Driver) PoolPath(name string) (string, bool) {
	p := d.pool(name)
	if p == nil {
		return "", false
	}
	return p.path, true
}

// pool returns the named pool, nil when it is not served.
func (d *Driver) pool(name string) *pool {
	d.poolsMu.RLock()
	defer d.poolsMu.RUnlock()
	return d.pools[name]
}

// poolList returns the served pools sorted by name.
func (d *Driver) poolList() []*pool {
	d.poolsMu.RLock()
	out := make([]*pool, 0, len(d.pools))
	for _, p := range d.pools {
		out = append(out, p)
	}
	d.poolsMu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// VolumeDisk returns where a VM's disk for volumeID lives, the way KubeVirt
// uses PVCs: for a filesystem volume the file disk.img inside the volume's
// mounted filesystem (it may not exist yet: the importer creates it); for a
// block volume the loop device itself.
func (d *Driver) VolumeDisk(volumeID string) (path string, isBlock bool, err error) {
	v, p, err := d.lookupVolume(volumeID)
	if err != nil {
		return "", false, err
	}
	if v.Block {
		if v.dev == "" {
			return "", true, fmt.Errorf("volume %s: block device is not attached", volumeID)
		}
		return v.dev, true, nil
	}
	return filepath.Join(p.mountDir(v.ID), DiskImageName), false, nil
}

// VolumePath returns the node directory holding a filesystem volume's
// mounted filesystem, or the device of a block volume. The legacy
// (non-CSI) provisioner points hostPath PVs at it.
func (d *Driver) VolumePath(volumeID string) (string, error) {
	path, isBlock, err := d.VolumeDisk(volumeID)
	if err != nil || isBlock {
		return path, err
	}
	return filepath.Dir(path), nil
}

func (d *Driver) lookupVolume(volumeID string) (volume, *pool, error) {
	if !validID(volumeID) {
		return volume{}, nil, fmt.Errorf("volume id %q is not valid", volumeID)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.volumes[volumeID]
	if !ok {
		return volume{}, nil, fmt.Errorf("volume %s: %w", volumeID, os.ErrNotExist)
	}
	return v.clone(), d.pool(v.Pool), nil
}

// keyedLocks serialises operations on the same volume, snapshot or name.
type keyedLocks struct {
	mu sync.Mutex
	m  map[string]*keyLock
}

type keyLock struct {
	mu   sync.Mutex
	refs int
}

// lock takes the lock for key and returns its release.
func (k *keyedLocks) lock(key string) func() {
	k.mu.Lock()
	if k.m == nil {
		k.m = map[string]*keyLock{}
	}
	l := k.m[key]
	if l == nil {
		l = &keyLock{}
		k.m[key] = l
	}
	l.refs++
	k.mu.Unlock()

	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		k.mu.Lock()
		l.refs--
		if l.refs == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
}

// Deactivate unmounts every publication and volume filesystem and detaches
// every loop device of this driver's volumes, keeping all data and records:
// what `make lab-down` or a node drain needs. A later New brings the
// volumes back. It returns the first error but tries every volume.
func (d *Driver) Deactivate() error {
	d.mu.Lock()
	vols := make([]volume, 0, len(d.volumes))
	for _, v := range d.volumes {
		vols = append(vols, v.clone())
	}
	d.mu.Unlock()
	var first error
	keep := func(err error) {
		if err != nil && first == nil {
			first = err
		}
	}
	for _, v := range vols {
		unlock := d.locks.lock("volume/" + v.ID)
		p := d.pool(v.Pool)
		for target, pub := range v.Published {
			keep(unmountIfMounted(target))
			if pub.Device != "" && loopBacking(pub.Device) == p.image(v.ID) {
				keep(detachLoop(pub.Device))
			}
		}
		keep(d.deactivate(p, &v))
		d.mu.Lock()
		if rec, ok := d.volumes[v.ID]; ok {
			rec.dev = v.dev
		}
		d.mu.Unlock()
		unlock()
	}
	return first
}
