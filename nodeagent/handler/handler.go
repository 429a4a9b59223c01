// Package handler is the virt-handler role of the node agent: it turns the
// VirtualMachineInstances bound to this node into libvirt domains and writes
// their status back.
//
// It watches only the VMIs labelled kubevirt.io/nodeName=<node> (the label
// the scheduler sets together with status.nodeName and phase Scheduled) and
// reconciles each one against its domain in the node's libvirtd:
//
//   - Scheduled, no domain: add the finalizer nodevirt.io/virt-handler,
//     resolve volumes (PVC/DataVolume → PV → CSI volume handle → disk), read
//     cloud-init Secrets, attach a tap per bridge NIC to the bridge of its
//     NetworkAttachmentDefinition and a tap per pod network NIC (masquerade)
//     to the node's pod network (package podnet), convert (launcher/domain),
//     define and start (paused for startStrategy Paused).
//   - a domain exists: phase, conditions (Ready, Paused, LiveMigratable,
//     Synchronized), status.interfaces (with the pod network's address of
//     pod network NICs) and the annotations nodevirt.io/qemu-pid and
//     nodevirt.io/emulation follow the domain.
//     Libvirt's lifecycle events trigger the reconcile; nothing polls.
//   - the guest powered off: Succeeded; QEMU died or the guest panicked:
//     Failed with status.reason; a final VMI's domain is undefined, its taps
//     detached, its state removed, and the finalizer dropped.
//   - deletionTimestamp set: ACPI shutdown within
//     spec.terminationGracePeriodSeconds (counted from the deletion), then
//     destroy, then as above.
//
// Domains are persistent libvirt domains whose QEMU is libvirtd's child:
// they outlive the agent. A restarted handler finds them by name
// (<namespace>_<name>) and checks the VMI UID in their metadata before
// adopting them (attaching their pod network taps again); it never
// touches a domain whose VMI state it did not create (Config.StateDir), so
// several agents may share one libvirtd in tests.
//
// Live migration (package migstate has the protocol): the handler also
// watches VirtualMachineInstanceMigrations naming this node. As the target
// it attaches the taps, makes volumes for node-local disks with the CSI
// driver, prepares the state directory and defines the domain; as the
// source it runs libvirt's peer-to-peer migration to the target's libvirtd
// (migration.go, migration_target.go). A guest that left by migration is
// no news for its VMI until the brain binds it to the target.
//
// Pause, unpause, soft reboot, reset, shutdown and the console and VNC
// streams are methods the console server (package console) calls for the
// brain's subresources.
package handler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirt"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/nodeagent/containerdisk"
	"github.com/nodevirt/nodevirt/nodeagent/hostdisk"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// Names the handler writes on VMIs.
const (
	// Finalizer keeps a VMI until its domain, taps and state are gone.
	Finalizer = "nodevirt.io/virt-handler"
	// AnnotationQEMUPID is the pid of the VMI's QEMU process.
	AnnotationQEMUPID = "nodevirt.io/qemu-pid"
	// AnnotationEmulation is "true" when the guest runs under TCG, "false"
	// under KVM.
	AnnotationEmulation = "nodevirt.io/emulation"
)

// DefaultGracePeriod is KubeVirt's terminationGracePeriodSeconds default.
const DefaultGracePeriod = 30 * time.Second

// VolumeResolver finds the disk of a CSI volume on this node; the hostpath
// CSI driver (csi.Driver) satisfies it. Without one, VMIs whose PVs are CSI
// volumes fail to start with a condition saying so; hostPath and local PVs
// still work.
type VolumeResolver interface {
	// VolumeDisk returns the disk image file inside a filesystem volume, or
	// the block device of a block volume.
	VolumeDisk(volumeHandle string) (path string, isBlock bool, err error)
}

// VolumeMaker makes and deletes volumes of this node's CSI driver: the
// volumes an incoming live migration copies node-local disks into. The
// hostpath driver (csi.Driver) satisfies it. Without one, VMIs with
// node-local disks cannot migrate to this node.
type VolumeMaker interface {
	CreateVolume(context.Context, *csispec.CreateVolumeRequest) (*csispec.CreateVolumeResponse, error)
	DeleteVolume(context.Context, *csispec.DeleteVolumeRequest) (*csispec.DeleteVolumeResponse, error)
}

// Config configures a Handler.
type Config struct {
	// NodeName is this node; required.
	NodeName string
	// StateDir holds one directory per VMI (by UID): disks the launcher
	// prepares, cloud-init seeds and the handler's record of what it made.
	// It must be reachable by the user QEMU runs as. Required, absolute.
	StateDir string
	// LibvirtURI of the node's libvirtd; launcher.DefaultURI when empty.
	LibvirtURI string
	// PIDDir is where libvirtd writes QEMU pid files; launcher's default
	// when empty.
	PIDDir string
	// Emulation runs guests under TCG. The KubeVirt CR's
	// spec.configuration.developerConfiguration.useEmulation turns it on
	// as well, at run time.
	Emulation bool
	// Kube and Virt are the API clients; required.
	Kube kube.Interface
	Virt *client.Set
	// Reads gives the Secrets the VMIs name (cloud-init, pull secrets):
	// the brain's nodereads API for an agent (nodes have no RBAC on
	// Secrets); nil reads them directly with Kube's credentials.
	Reads nodereads.Reader
	// VMIs is the informer of this node's VMIs (labelled
	// kubevirt.io/nodeName=<NodeName>), shared with other roles and run
	// by whoever made it; nil makes the handler its own, run by Run.
	VMIs cache.SharedIndexInformer
	// Volumes resolves CSI volume handles; may be nil (see VolumeResolver).
	Volumes VolumeResolver
	// VolumeMaker makes the target volumes of incoming migrations; may
	// be nil (see VolumeMaker).
	VolumeMaker VolumeMaker
	// HostDiskRoot is the only directory hostDisk volumes may name files
	// in (hostdisk.DefaultRoot when empty); absolute.
	HostDiskRoot string
	// PodNetwork is the node's NAT network for pod network interfaces
	// (masquerade, or bridge binding on the pod network); nil: none, and
	// VMIs using it fail (see PodNetwork).
	PodNetwork PodNetwork
	// PodNetworkErr is why PodNetwork could not be set up at start; VMIs
	// that need it wait with this error in their Synchronized condition.
	PodNetworkErr error
	// NetStateDir overrides the bridge package's state directory in every
	// NetworkAttachmentDefinition config (tests); empty keeps the config's.
	NetStateDir string
	// Workers is the number of VMIs reconciled at once; 4 when zero.
	Workers int
	// ShutdownRetry is how often the ACPI power button is pressed again
	// during a graceful shutdown; the launcher's default when zero.
	ShutdownRetry time.Duration
	// AgentPollInterval is how often a connected guest agent is asked for
	// the guest's OS and addresses; DefaultAgentPollInterval when zero.
	AgentPollInterval time.Duration
	// Console configures the console/VNC/control server; no server when
	// Console.Addr is empty.
	Console console.Config
	// NodeIP is this node's InternalIP, where other nodes' libvirtd
	// reach this one's for live migrations; empty: this node cannot be a
	// migration target.
	NodeIP string
	// MigrationTransport is how the nodes' libvirt daemons talk during a
	// live migration: TransportTLS (default) or TransportTCP (lab only).
	MigrationTransport string
	// MigrationPKIDir is where the node certificate is kept in libvirt's
	// TLS layout, handed to the source's libvirtd as pkipath= of the
	// migration URI (TransportTLS); empty: libvirt's default files
	// (/etc/pki/CA/cacert.pem, /etc/pki/libvirt/...).
	MigrationPKIDir string
	// Log; slog.Default() when nil.
	Log *slog.Logger
}

func (c *Config) defaults() {
	if c.Workers == 0 {
		c.Workers = 4
	}
	if c.AgentPollInterval == 0 {
		c.AgentPollInterval = DefaultAgentPollInterval
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Reads == nil && c.Kube != nil {
		c.Reads = nodereads.Direct{Core: c.Kube}
	}
	if c.MigrationTransport == "" {
		c.MigrationTransport = TransportTLS
	}
}

func (c *Config) validate() error {
	switch {
	case c.MigrationPKIDir != "" && (!filepath.IsAbs(c.MigrationPKIDir) || strings.ContainsAny(c.MigrationPKIDir, "?&#%+ ")):
		return fmt.Errorf("handler: migration pki dir %q is not a plain absolute path", c.MigrationPKIDir)
	case c.NodeName == "":
		return errors.New("handler: node name is required")
	case !filepath.IsAbs(c.StateDir):
		return fmt.Errorf("handler: state dir %q is not an absolute path", c.StateDir)
	case c.Kube == nil || c.Virt == nil:
		return errors.New("handler: kubernetes clients are required")
	case c.Workers < 0:
		return errors.New("handler: negative worker count")
	case c.AgentPollInterval < 0:
		return errors.New("handler: negative agent poll interval")
	case c.MigrationTransport != TransportTLS && c.MigrationTransport != TransportTCP:
		return fmt.Errorf("handler: migration transport %q is neither %s nor %s", c.MigrationTransport, TransportTLS, TransportTCP)
	}
	return nil
}

// Handler is the virt-handler role.
type Handler struct {
	cfg Config
	log *slog.Logger

	vmis     cache.SharedIndexInformer
	ownVMIs  bool
	kubevirt cache.SharedIndexInformer
	queue    *controller.Queue // set by Run
	// migrations and migQueue drive this node's part in live migrations
	// (migration.go); migQueue is set by Run.
	migrations cache.SharedIndexInformer
	migQueue   *controller.Queue
	console    *console.Server
	// hostDisks confines hostDisk volumes to Config.HostDiskRoot.
	hostDisks *hostdisk.Resolver

	mu       sync.Mutex
	lv       *launcher.Manager // set while Run runs
	runCtx   context.Context
	stopping map[types.UID]bool
	adopted  map[types.UID]bool // pod network taps attached in this run
	// migrating cancels the outgoing migrations under way (by migration
	// UID); migratedAway holds the VMIs whose guest left this node, until
	// the brain moves them.
	migrating    map[types.UID]context.CancelFunc
	migratedAway map[types.UID]bool
	// agentPolled: when each VMI's (namespace/name) guest agent was last
	// asked.
	agentPolled map[string]agentPoll
	// thaws thaw the guests frozen for a snapshot (by namespace/name)
	// that nobody thawed within its unfreeze timeout.
	thaws map[string]*time.Timer
	bg    sync.WaitGroup // graceful shutdowns under way
	ready chan struct{}
	// cdisks is the containerDisk image cache, made on first use
	// (containerdisk.go).
	cdisks *containerdisk.Puller
	// recorder puts Kubernetes Events on VMIs (kubectl describe vmi),
	// sent while Run runs.
	recorder *controller.Recorder
}

type agentPoll struct {
	uid types.UID
	at  time.Time
}

var (
	_ console.Backend           = (*Handler)(nil)
	_ console.GuestAgentBackend = (*Handler)(nil)
	_ console.FreezeBackend     = (*Handler)(nil)
)

// New validates cfg and builds the handler; with Console.Addr set it also
// starts listening there (so ConsoleAddr is known), serving once Run runs.
func New(cfg Config) (*Handler, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	h := &Handler{
		cfg:      cfg,
		log:      cfg.Log.With("role", "virt-handler", "node", cfg.NodeName),
		stopping: map[types.UID]bool{},
		adopted:  map[types.UID]bool{},
		ready:    make(chan struct{}),

		migrating:    map[types.UID]context.CancelFunc{},
		migratedAway: map[types.UID]bool{},

		agentPolled: map[string]agentPoll{},
		recorder:    controller.NewNodeRecorder(client.NewScheme(), "virt-handler", cfg.NodeName),
	}
	h.vmis, h.ownVMIs = cfg.VMIs, cfg.VMIs == nil
	if h.ownVMIs {
		h.vmis = NodeVMIInformer(cfg.Virt, cfg.NodeName)
	}
	h.kubevirt = cfg.Virt.KubeVirts.Informer(metav1.NamespaceAll, 0, nil)
	h.migrations = cfg.Virt.Migrations.Informer(metav1.NamespaceAll, 10*time.Minute, nil)
	hd, err := hostdisk.New(cfg.HostDiskRoot)
	if err != nil {
		return nil, fmt.Errorf("handler: %w", err)
	}
	h.hostDisks = hd
	if cfg.Console.Addr != "" {
		ccfg := cfg.Console
		if ccfg.Log == nil {
			ccfg.Log = cfg.Log
		}
		s, err := console.New(ccfg, h)
		if err != nil {
			return nil, err
		}
		h.console = s
	}
	return h, nil
}

// Name is the role's name.
func (h *Handler) Name() string { return "virt-handler" }

// ConsoleAddr is the address the console server listens on; empty without
// one.
func (h *Handler) ConsoleAddr() string {
	if h.console == nil {
		return ""
	}
	return h.console.Addr()
}

// AllDomainStats reads libvirt's statistics of the node's domains over the
// handler's launcher connections, so the node's metrics share them; before
// Run has connected (and after it returned) it fails with
// launcher.ErrDisconnected.
func (h *Handler) AllDomainStats(stats libvirt.DomainStatsTypes, flags libvirt.ConnectGetAllDomainStatsFlags) ([]libvirt.DomainStats, error) {
	h.mu.Lock()
	lv := h.lv
	h.mu.Unlock()
	if lv == nil {
		return nil, launcher.ErrDisconnected
	}
	return lv.AllDomainStats(stats, flags)
}

// Ready is closed once Run has connected to libvirtd, synced its caches and
// queued every VMI and every domain it made.
func (h *Handler) Ready() <-chan struct{} { return h.ready }

// Run reconciles until ctx ends. Domains keep running when it returns.
func (h *Handler) Run(ctx context.Context) error {
	if h.queue != nil {
		return errors.New("handler: Run called twice")
	}
	lv, err := launcher.Open(launcher.Config{
		URI: h.cfg.LibvirtURI, PIDDir: h.cfg.PIDDir, ShutdownRetry: h.cfg.ShutdownRetry, Logger: h.cfg.Log,
	})
	if err != nil {
		return err
	}
	defer lv.Close()
	h.mu.Lock()
	h.lv = lv
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.lv, h.runCtx = nil, nil
		h.mu.Unlock()
	}()

	defer h.recorder.Start(h.cfg.Kube)()
	if h.queue, err = controller.New(controller.Config{Name: "virt-handler", Sync: controller.NoRequeue(h.sync),
		Backoff: controller.BackoffNodeLocal, Workers: h.cfg.Workers, Log: h.log, KeyAttr: "vmi"}); err != nil {
		return err
	}
	defer h.queue.ShutDown()
	if h.migQueue, err = controller.New(controller.Config{Name: "virt-handler-migrations", Sync: controller.NoRequeue(h.syncMigration),
		Backoff: controller.BackoffNodeLocal, Workers: 1, Log: h.log, KeyAttr: "migration"}); err != nil {
		return err
	}
	defer h.migQueue.ShutDown()
	if _, err := h.migrations.AddEventHandler(controller.OnChange(h.enqueueMigration)); err != nil {
		return err
	}
	if _, err := h.vmis.AddEventHandler(controller.OnChange(h.queue.Enqueue)); err != nil {
		return err
	}
	defer h.bg.Wait()
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	h.mu.Lock()
	h.runCtx = ctx
	h.mu.Unlock()
	run := []cache.SharedIndexInformer{h.kubevirt, h.migrations}
	if h.ownVMIs {
		run = append(run, h.vmis)
	}
	for _, inf := range run {
		wg.Add(1)
		go func() { defer wg.Done(); inf.Run(ctx.Done()) }()
	}
	if !cache.WaitForCacheSync(ctx.Done(), h.vmis.HasSynced, h.kubevirt.HasSynced, h.migrations.HasSynced) {
		return ctx.Err()
	}
	wg.Add(1)
	go func() { defer wg.Done(); h.watchDomains(ctx, lv) }()
	if err := h.queueOwnDomains(ctx, lv); err != nil {
		h.log.Warn("listing domains", "err", err)
	}
	if err := h.sweepPodNetwork(ctx); err != nil {
		h.log.Warn("detaching stale pod network interfaces", "err", err)
	}
	if h.console != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := h.console.Run(ctx); err != nil && ctx.Err() == nil {
				h.log.Error("console server stopped", "err", err)
			}
		}()
	}
	wg.Add(1)
	go func() { defer wg.Done(); _ = h.migQueue.Run(ctx) }()
	if err := h.sweepTargets(ctx); err != nil {
		h.log.Warn("removing the targets of deleted migrations", "err", err)
	}
	close(h.ready)
	h.log.Info("virt-handler running", "emulation", h.emulation())
	_ = h.queue.Run(ctx) // no caches to wait for: synced above
	return nil
}

// watchDomains turns libvirt's lifecycle events into reconciles of the
// domain's VMI; a reconnect to libvirtd reconciles every VMI.
func (h *Handler) watchDomains(ctx context.Context, lv *launcher.Manager) {
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-lv.Events():
			if !ok {
				return
			}
			if e.Type == launcher.EventReconnected {
				h.log.Info("libvirtd connection restored, reconciling every vmi")
				for _, key := range h.vmis.GetStore().ListKeys() {
					h.queue.Add(key)
				}
				continue
			}
			if e.Type == launcher.EventAgentConnected || e.Type == launcher.EventAgentDisconnected {
				if ns, name, ok := domain.SplitName(e.Domain); ok {
					h.log.Debug("guest agent "+e.Type.String(), "vmi", ns+"/"+name, "reason", e.Reason)
					h.forgetAgentKey(ns + "/" + name)
					h.queue.Add(ns + "/" + name)
				}
				continue
			}
			if e.Type == launcher.EventDefined || e.Type == launcher.EventUndefined {
				// The handler's own doing; state changes come as other
				// events. (A failed start re-defines: no hot retry loop.)
				continue
			}
			if ns, name, ok := domain.SplitName(e.Domain); ok {
				h.log.Debug("domain event", "vmi", ns+"/"+name, "event", e.String())
				h.queue.Add(ns + "/" + name)
			}
		}
	}
}

// queueOwnDomains queues the VMIs of the domains and state records this
// handler made, so that those whose VMI is gone get cleaned up.
func (h *Handler) queueOwnDomains(ctx context.Context, lv *launcher.Manager) error {
	recs, err := h.records()
	for _, r := range recs {
		h.queue.Add(r.Namespace + "/" + r.Name)
	}
	doms, lerr := lv.List(ctx)
	for _, d := range doms {
		if d.HasVMI && h.owns(types.UID(d.VMI.UID)) {
			h.queue.Add(d.VMI.Namespace + "/" + d.VMI.Name)
		}
	}
	return errors.Join(err, lerr)
}

// manager returns the libvirt connection of the running handler.
func (h *Handler) manager() (*launcher.Manager, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lv == nil {
		return nil, fmt.Errorf("%w: handler is not running", launcher.ErrDisconnected)
	}
	return h.lv, nil
}

// emulation is the configured decision, or'ed with the KubeVirt CR's
// useEmulation.
func (h *Handler) emulation() bool {
	if h.cfg.Emulation {
		return true
	}
	for _, o := range h.kubevirt.GetStore().List() {
		kv, ok := o.(*v1.KubeVirt)
		if !ok {
			continue
		}
		if dc := kv.Spec.Configuration.DeveloperConfiguration; dc != nil && dc.UseEmulation {
			return true
		}
	}
	return false
}

// NodeVMIInformer is an informer of the VMIs bound to node (labelled
// kubevirt.io/nodeName=<node>), for sharing between the node's roles.
func NodeVMIInformer(virt *client.Set, node string) cache.SharedIndexInformer {
	selector := v1.NodeNameLabel + "=" + node
	return virt.VMIs.Informer(metav1.NamespaceAll, 10*time.Minute, func(o *metav1.ListOptions) {
		o.LabelSelector = selector
	})
}
