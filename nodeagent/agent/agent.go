// Package agent wires the per-node daemon: it registers the Node, decides
// between KVM and emulation, and runs the node roles (virt-handler,
// bridge-marker, CSI driver and provisioner, importer) in one process.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
	"github.com/nodevirt/nodevirt/clusterbrain/api/fencing"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/logverbosity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/nodeagent/handler"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
	"github.com/nodevirt/nodevirt/nodeagent/kvm"
	nodemetrics "github.com/nodevirt/nodevirt/nodeagent/metrics"
	"github.com/nodevirt/nodevirt/nodeagent/node"
	"github.com/nodevirt/nodevirt/nodeagent/nodecert"
	"github.com/nodevirt/nodevirt/nodeagent/podnet"
)

// Emulation modes.
const (
	EmulationAuto = "auto"
	EmulationOn   = "on"
	EmulationOff  = "off"
)

// Config is the agent's configuration.
type Config struct {
	Kubeconfig string
	// NodeName is this node's name (default: host name).
	NodeName string
	// NodeIP is the node's InternalIP, where the brain and other nodes
	// reach its endpoints; New fills it from the node's interfaces when
	// empty (node.InternalIP), never with loopback.
	NodeIP string
	// MigrationTransport is how this node's libvirtd reaches another's
	// in a live migration: tls (default; libvirt's TLS transport with the
	// node's certificates) or tcp (no authentication, for a lab on one
	// machine only).
	MigrationTransport string
	// StateDir holds per-VM state, volumes' default pool and sockets.
	StateDir string
	// HealthAddr serves /healthz and /readyz.
	HealthAddr string
	// Emulation is auto (probe KVM), on (TCG) or off (KVM required).
	Emulation string
	// LibvirtURI is the node's libvirt.
	LibvirtURI string
	// CSISocket is where the hostpath CSI driver listens.
	CSISocket string
	// KubeletPluginDir is kubelet's plugin registry directory, where the
	// agent registers the CSI driver so kubelet's pods can use its volumes
	// (pluginreg.DefaultDir when empty, "-" for none; a missing directory
	// means no kubelet).
	KubeletPluginDir string
	// Pools maps storage pool names to directories (--pools): always
	// served, and preferred over a HostPathProvisioner's pool of the same
	// name; HostPathProvisioners' pools are added beside them.
	Pools map[string]string
	// HostDiskRoot is the only directory hostDisk volumes may name files
	// in (hostdisk.DefaultRoot when empty).
	HostDiskRoot string
	// Console is the mTLS console/VNC/control server the brain calls;
	// none when Console.Addr is "-". Without certificate files or TLS it
	// serves the node's own certificate, requested from the brain by CSR.
	Console console.Config
	// CertDir keeps the node's key and certificate (default
	// <StateDir>/pki); the key never leaves it.
	CertDir string
	// LibvirtPKIDir gets the node certificate, its key and the node CA in
	// libvirt's TLS layout when MigrationTransport is tls (default
	// <StateDir>/libvirt-pki): the source's libvirtd reads it as the
	// client (pkipath= of the migration URI); this node's libvirtd must be
	// configured to serve it (libvirtd.conf key_file, cert_file, ca_file).
	LibvirtPKIDir string
	// QEMUTLSDir gets them in QEMU's x509 layout for QEMU's native TLS of
	// the migration stream (default <StateDir>/qemu-tls), readable by
	// QEMUGroup (a name or a gid; default libvirt-qemu), the group QEMU
	// runs as (qemu.conf group).
	QEMUTLSDir string
	QEMUGroup  string
	// LibvirtConfDir, when set, is libvirt's configuration directory where
	// the agent keeps its TLS blocks in libvirtd.conf and qemu.conf
	// (package libvirttls); LibvirtRestart is the shell command that
	// restarts libvirtd after they changed; LibvirtAdminURI reaches
	// libvirtd's admin socket for server-update-tls after a renewal
	// (default libvirtd:///system).
	LibvirtConfDir  string
	LibvirtRestart  string
	LibvirtAdminURI string
	// CertDuration is the node certificate lifetime asked for (default 24h);
	// it is renewed at two thirds of it.
	CertDuration time.Duration
	// BrainNamespace is where the brain keeps its Secrets.
	BrainNamespace string
	// UploadAddr receives uploads from the brain's upload proxy over mutual
	// TLS; "-" for none.
	UploadAddr string
	// MetricsAddr serves /metrics (KubeVirt's per-VMI metrics of this
	// node); nodemetrics.DefaultAddr when empty, "-" for none.
	MetricsAddr string
	// PodCIDR is the node subnet of the pod network (masquerade
	// interfaces), podnet.DefaultCIDR when empty; "-" for no pod network.
	PodCIDR string
	// PodBridge is the pod network's bridge, podnet.DefaultBridge when
	// empty. Its state lives in <StateDir>/podnet.
	PodBridge string
	// SelfFence is what the agent does when it cannot renew its Lease for
	// longer than FencingWindow and reaches no peer: fencing.ModeStop
	// (default) stops its guests, fencing.ModeNone nothing.
	SelfFence     string
	FencingWindow time.Duration
	// Heartbeat is how often the Lease and Ready condition are renewed
	// (10 s when zero); the fencing window must span at least two.
	Heartbeat time.Duration
	Log       *slog.Logger
	// LogLevel, when set, is Log's level, which then follows the KubeVirt
	// CR's logVerbosity for this node, while the import role follows the
	// CDI CR's (package logverbosity).
	LogLevel *slog.LevelVar
}

func (c *Config) defaults() {
	if c.NodeName == "" {
		c.NodeName, _ = os.Hostname()
	}
	if c.StateDir == "" {
		c.StateDir = "/var/lib/nodevirt"
	}
	if c.HealthAddr == "" {
		c.HealthAddr = "127.0.0.1:8481"
	}
	if c.Emulation == "" {
		c.Emulation = EmulationAuto
	}
	if c.LibvirtURI == "" {
		c.LibvirtURI = "qemu:///system"
	}
	if c.Console.Addr == "" {
		c.Console.Addr = DefaultConsoleAddr
	}
	if c.Console.Addr == "-" {
		c.Console.Addr = ""
	}
	if c.UploadAddr == "" {
		c.UploadAddr = ":8447"
	}
	if c.UploadAddr == "-" {
		c.UploadAddr = ""
	}
	if c.MetricsAddr == "" {
		c.MetricsAddr = nodemetrics.DefaultAddr
	}
	if c.MetricsAddr == "-" {
		c.MetricsAddr = ""
	}
	if c.PodCIDR == "" {
		c.PodCIDR = podnet.DefaultCIDR
	}
	if c.PodBridge == "" {
		c.PodBridge = podnet.DefaultBridge
	}
	if c.SelfFence == "" {
		c.SelfFence = fencing.ModeStop
	}
	if c.FencingWindow == 0 {
		c.FencingWindow = fencing.DefaultWindow
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = 10 * time.Second
	}
	if c.CertDir == "" {
		c.CertDir = filepath.Join(c.StateDir, "pki")
	}
	if c.LibvirtPKIDir == "" {
		c.LibvirtPKIDir = filepath.Join(c.StateDir, "libvirt-pki")
	}
	if c.QEMUTLSDir == "" {
		c.QEMUTLSDir = filepath.Join(c.StateDir, "qemu-tls")
	}
	if c.QEMUGroup == "" {
		c.QEMUGroup = "libvirt-qemu"
	}
	if c.BrainNamespace == "" {
		c.BrainNamespace = "kubevirt-hyperconverged"
	}
	if c.CSISocket == "" {
		c.CSISocket = "/var/lib/kubelet/plugins/kubevirt.io.hostpath-provisioner/csi.sock"
	}
	if len(c.Pools) == 0 {
		c.Pools = map[string]string{csi.DefaultPoolName: c.StateDir + "/pools/" + csi.DefaultPoolName}
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	switch c.Emulation {
	case EmulationAuto, EmulationOn, EmulationOff:
	default:
		return fmt.Errorf("emulation must be auto, on or off, not %q", c.Emulation)
	}
	if c.NodeName == "" {
		return errors.New("node name is required")
	}
	if c.SelfFence != fencing.ModeStop && c.SelfFence != fencing.ModeNone {
		return fmt.Errorf("self-fence must be %s or %s, not %q", fencing.ModeStop, fencing.ModeNone, c.SelfFence)
	}
	if c.Heartbeat < time.Second {
		return fmt.Errorf("heartbeat %s: at least 1s", c.Heartbeat)
	}
	if c.FencingWindow < 2*c.Heartbeat {
		return fmt.Errorf("fencing window %s: at least two heartbeats (%s)", c.FencingWindow, 2*c.Heartbeat)
	}
	return nil
}

// DefaultConsoleAddr is where the console server listens by default: every
// address, on the port the brain assumes for a Node that publishes none.
var DefaultConsoleAddr = ":" + strconv.Itoa(identity.HandlerPort)

// Deps is what every node role gets.
type Deps struct {
	Config     Config
	RestConfig *rest.Config
	Kube       kube.Interface
	Virt       *client.Set
	// Reads reads the Secrets and ConfigMaps of this node's VMIs and
	// DataVolumes through the brain (nodes have no RBAC on either).
	Reads nodereads.Reader
	// Informers are the claim, volume and class informers the storage
	// roles share (one cache and one watch of each kind for the node).
	Informers *kube.Factory
	// VMIs is the informer of this node's VMIs, shared by the handler and
	// the metrics server (one cache and one watch); Run runs it.
	VMIs cache.SharedIndexInformer
	Log  *slog.Logger
	// CDILog is the import role's logger (CDI's importer, cloner and
	// upload server): with Config.LogLevel, at the CDI CR's verbosity
	// (logverbosity.CDIRoles); else Log.
	CDILog *slog.Logger
	Health *daemon.Health
	// Emulation is the decision taken at start: guests run under TCG.
	Emulation bool
	// Volumes is the node's hostpath CSI driver, served on the CSI socket
	// and called in-process for disk paths and provisioning.
	Volumes *csi.Driver
	// PodNetwork is the node's pod network (nil with PodCIDR "-");
	// PodNetworkErr is why its setup at start failed, if it did.
	PodNetwork    *podnet.Network
	PodNetworkErr error
	// Cert is the node's own certificate (nil when no endpoint needs it).
	Cert *nodecert.Source
	// ClusterConfig follows the KubeVirt and CDI CRs for the servers' TLS
	// settings: KubeVirtTLS for the console server (virt-handler's),
	// CDITLS for the upload and export endpoint (CDI's upload server).
	ClusterConfig       *crwatch.Watch
	KubeVirtTLS, CDITLS *tlsprofile.Live
	// Handler is the virt-handler role, set when it is built; the roles
	// built after it reach the node's libvirt through it (one set of
	// connections per agent).
	Handler *handler.Handler
}

// Role is one job of the node agent.
type Role = daemon.Role

// RoleFactory builds a role.
type RoleFactory func(d *Deps) (Role, error)

// Agent is a running node agent.
type Agent struct {
	cfg   Config
	deps  *Deps
	reg   *node.Registrar
	roles []Role
}

// New validates cfg, decides KVM or emulation, and builds the roles.
func New(cfg Config) (*Agent, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rc, err := clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	if err != nil {
		return nil, err
	}
	rc.QPS, rc.Burst = 50, 100
	kc, err := kube.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	virt, err := client.NewSet(rc)
	if err != nil {
		return nil, err
	}
	reads, err := nodereads.NewClient(rc)
	if err != nil {
		return nil, err
	}
	nodeIP, err := node.InternalIP(cfg.NodeIP)
	if err != nil {
		return nil, err
	}
	cfg.NodeIP = nodeIP.String()
	cert, libvirtTLS, err := nodeCertificate(&cfg, kc)
	if err != nil {
		return nil, err
	}
	emulation, reason := decideEmulation(cfg.Emulation)
	cfg.Log.Info("virtualization", "node", cfg.NodeName, "ip", cfg.NodeIP, "emulation", emulation, "reason", reason)
	if cfg.Emulation == EmulationOff && emulation {
		return nil, fmt.Errorf("kvm required but unusable: %s", reason)
	}
	reg, err := node.New(node.Config{Name: cfg.NodeName, InternalIP: cfg.NodeIP, Heartbeat: cfg.Heartbeat, Emulation: emulation, Reason: reason, Log: cfg.Log,
		// Volumes' node affinity uses the CSI topology key, which kubelet
		// would publish from NodeGetInfo; without a kubelet the agent does.
		Labels:         map[string]string{csi.TopologyKey: cfg.NodeName},
		PeerAnnotation: identity.NodeAddressAnnotation}, kc)
	if err != nil {
		return nil, err
	}
	// The state dir must exist, traversable by QEMU's user, before any role
	// creates something inside it (VM seeds and disks live below it).
	if err := os.MkdirAll(cfg.StateDir, 0o755); err != nil {
		return nil, err
	}
	if err := os.Chmod(cfg.StateDir, 0o755); err != nil {
		return nil, err
	}
	volumes, err := newVolumes(cfg)
	if err != nil {
		return nil, err
	}
	d := &Deps{Config: cfg, RestConfig: rc, Kube: kc, Virt: virt, Reads: reads, Informers: kube.NewFactory(kc, 10*time.Minute),
		VMIs: handler.NodeVMIInformer(virt, cfg.NodeName), Log: cfg.Log,
		Health: daemon.NewHealth("node-registered"), Emulation: emulation, Volumes: volumes, Cert: cert,
		ClusterConfig: crwatch.New(virt, cfg.BrainNamespace), KubeVirtTLS: tlsprofile.NewLive(), CDITLS: tlsprofile.NewLive()}
	d.Config.Console.TLSProfile = d.KubeVirtTLS
	tlsprofile.Follow(d.ClusterConfig, d.KubeVirtTLS, d.CDITLS, d.Log)
	d.CDILog = d.Log
	if cfg.LogLevel != nil {
		logverbosity.Follow(d.ClusterConfig, cfg.LogLevel, logverbosity.Node(cfg.NodeName), d.Log)
		d.CDILog = logverbosity.CDIRoles(d.ClusterConfig, d.Log)
	}
	if d.PodNetwork, d.PodNetworkErr, err = setupPodNetwork(cfg); err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, deps: d, reg: reg}
	a.roles = append(a.roles, d.ClusterConfig)
	if cert != nil {
		a.roles = append(a.roles, cert)
	}
	if libvirtTLS != nil {
		a.roles = append(a.roles, libvirtTLS)
	}
	for _, f := range nodeRoles {
		r, err := f(d)
		if err != nil {
			return nil, err
		}
		a.roles = append(a.roles, r)
	}
	if cfg.SelfFence == fencing.ModeStop {
		for _, r := range a.roles {
			if g, ok := r.(GuestStopper); ok {
				a.roles = append(a.roles, &fencer{window: cfg.FencingWindow, renewed: reg.LastRenewal, peers: reg.Peers, guests: g,
					log: func(msg string, args ...any) { cfg.Log.Warn(msg, append(args, "node", cfg.NodeName)...) }})
				break
			}
		}
	}
	return a, nil
}

// newVolumes builds the CSI driver over the configured pools; the pool named
// "default" (else the first by name) serves claims that name no pool.
func newVolumes(cfg Config) (*csi.Driver, error) {
	var pools []csi.PoolConfig
	for name, path := range cfg.Pools {
		pools = append(pools, csi.PoolConfig{Name: name, Path: path})
	}
	sort.Slice(pools, func(i, j int) bool { return pools[i].Name < pools[j].Name })
	def := pools[0].Name
	if _, ok := cfg.Pools[csi.DefaultPoolName]; ok {
		def = csi.DefaultPoolName
	}
	return csi.New(csi.Config{NodeID: cfg.NodeName, Endpoint: cfg.CSISocket,
		StateRoot: filepath.Join(cfg.StateDir, "csi"), Pools: pools, DefaultPool: def,
		Logger: cfg.Log.With("role", "csi"), ObserveCall: observeCSICall, SharePools: true})
}

// csiDuration times the CSI driver's calls, served by the node's /metrics.
var csiDuration = metrics.Default().Histogram("nodevirt_csi_operation_duration_seconds",
	"Duration of the hostpath CSI driver's gRPC calls.", metrics.LatencyBuckets, "method", "code")

func observeCSICall(method string, code codes.Code, took time.Duration) {
	csiDuration.With(method, code.String()).Observe(took.Seconds())
}

func decideEmulation(mode string) (bool, string) {
	switch mode {
	case EmulationOn:
		return true, "emulation forced by configuration"
	}
	if !kvm.Present("/dev/kvm") {
		return true, "no /dev/kvm on this host"
	}
	r := kvm.Probe("/dev/kvm", 2*time.Second)
	return !r.Usable, r.Reason
}

// Run registers the node and runs every role until ctx ends.
func (a *Agent) Run(ctx context.Context) error {
	log := a.cfg.Log
	errc := make(chan error, 1)
	go func() { errc <- daemon.Serve(ctx, a.cfg.HealthAddr, a.deps.Health.Handler(), log) }()
	standalone, err := a.reg.Register(ctx)
	if err != nil {
		return err
	}
	if a.cfg.Console.Addr != "" {
		if err := advertiseConsole(ctx, a.cfg, a.deps.Kube, a.cfg.Console.Addr); err != nil {
			return fmt.Errorf("advertise console server: %w", err)
		}
	}
	// Ready only once the Node says where its console server is: the brain
	// cannot reach a node it has no address for.
	a.deps.Health.Set("node-registered", nil)
	log.Info("node registered", "node", a.cfg.NodeName, "standalone", standalone)
	go a.deps.VMIs.RunWithContext(ctx)
	roles := append([]Role{namedRole{"node", a.reg.Run}}, a.roles...)
	wg := daemon.Start(ctx, log.With("node", a.cfg.NodeName), a.deps.Health, roles...)
	_ = daemon.Notify("READY=1")
	go daemon.Watchdog(ctx, a.deps.Health.Ready)
	wg.Wait()
	// The storage roles started the shared informers with ctx: they stop
	// with it.
	a.deps.Informers.Shutdown()
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}
