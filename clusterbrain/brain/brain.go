// Package brain wires the cluster brain: it installs the API (the
// virt-operator role), elects one leader among the running brains and runs
// the roles — each a package of its own — while it leads.
package brain

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
	"github.com/nodevirt/nodevirt/clusterbrain/api/fencing"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/logverbosity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/crds"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon"
	"github.com/nodevirt/nodevirt/clusterbrain/nodefailure"
	"github.com/nodevirt/nodevirt/clusterbrain/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp"
)

// Config is the brain's configuration.
type Config struct {
	// Kubeconfig is a kubeconfig path; empty means in-cluster.
	Kubeconfig string
	// Namespace holds the brain's lease, secrets and the HyperConverged CR.
	Namespace string
	// Identity names this brain in leader election (default host name + pid).
	Identity string
	// HealthAddr serves /healthz and /readyz.
	HealthAddr string
	// WebhookAddr serves the admission webhooks (the API server calls it by
	// URL, so loopback suffices on a single machine, unless WebhookService
	// is set).
	WebhookAddr string
	// WebhookService, "namespace/name", makes the webhook configurations
	// name a Service in front of every brain instead of WebhookAddr's URL
	// (clusters with several API servers); WebhookAddr must then be
	// reachable on a host address.
	WebhookService string
	// SubresourcesAddr serves subresources.kubevirt.io to the aggregator;
	// it must be reachable on a non-loopback address of this host.
	SubresourcesAddr string
	// UploadAPIAddr serves upload.cdi.kubevirt.io to the aggregator.
	UploadAPIAddr string
	// UploadProxyAddr is the upload proxy virtctl image-upload talks to.
	UploadProxyAddr string
	// TemplateAPIAddr serves template.openshift.io (common templates and
	// their processing) to the aggregator; not loopback.
	TemplateAPIAddr string
	// NodeReadsAddr serves nodereads.nodevirt.io (the Secrets and
	// ConfigMaps of what is on a node, to that node) to the aggregator;
	// not loopback.
	NodeReadsAddr string
	// MetricsAddr serves /metrics.
	MetricsAddr string
	// CLIDownloadAddr serves the virtctl downloads from VirtctlDir.
	CLIDownloadAddr string
	VirtctlDir      string
	// LeaseDuration bounds how long a dead leader holds the lease.
	LeaseDuration time.Duration
	// FencingWindow is how long a node may go without renewing its Lease
	// before its agent stops its guests; the brain fails its VMIs over
	// after the window plus fencing.DefaultMargin (package fencing). Never
	// shorter than the agents' --fencing-window.
	FencingWindow time.Duration
	// CapacityPods keeps a pod per bound VMI that holds its CPU and memory
	// for kube-scheduler and kubelet (package capacitypods): for clusters
	// where kubelets run pods beside the VMs. CapacityPodImage is the pause
	// image those pods run (capacitypods.DefaultImage when empty).
	CapacityPods     bool
	CapacityPodImage string
	// Deployment names the brain's own Deployment in Namespace, which
	// the HyperConverged's spec.infra.nodePlacement places (empty: the
	// brain is not run by a Deployment).
	Deployment string
	// Log receives structured logs.
	Log *slog.Logger
	// LogLevel, when set, is Log's level, which then follows the KubeVirt
	// CR's logVerbosity, while the roles played for CDI follow the CDI
	// CR's (package logverbosity).
	LogLevel *slog.LevelVar
}

func (c *Config) defaults() {
	if c.Namespace == "" {
		c.Namespace = "kubevirt-hyperconverged"
	}
	if c.Identity == "" {
		host, _ := os.Hostname()
		c.Identity = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	for _, d := range []struct {
		addr *string
		def  string
	}{
		{&c.HealthAddr, "127.0.0.1:8480"}, {&c.WebhookAddr, "127.0.0.1:8443"}, {&c.SubresourcesAddr, ":8444"},
		{&c.UploadAPIAddr, ":8445"}, {&c.UploadProxyAddr, ":8446"}, {&c.TemplateAPIAddr, ":8448"}, {&c.MetricsAddr, DefaultMetricsAddr},
		{&c.NodeReadsAddr, nodereads.DefaultAddr},
		{&c.CLIDownloadAddr, ":8482"}, {&c.VirtctlDir, "/usr/local/share/nodevirt/virtctl"},
	} {
		if *d.addr == "" {
			*d.addr = d.def
		}
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = 10 * time.Second
	}
	if c.FencingWindow == 0 {
		c.FencingWindow = fencing.DefaultWindow
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	if c.LeaseDuration < 3*time.Second {
		return errors.New("lease duration must be at least 3s")
	}
	return nil
}

// Deps is what every role gets from the brain.
type Deps struct {
	Config     Config
	RestConfig *rest.Config
	Kube       kubernetes.Interface
	Virt       *client.Set
	Log        *slog.Logger
	// CDILog is the logger of the roles the brain plays for CDI (the
	// DataVolume and DataImportCron controllers, the upload API and proxy):
	// with Config.LogLevel, at the CDI CR's verbosity (logverbosity.CDIRoles);
	// else Log.
	CDILog *slog.Logger
	Health *daemon.Health
	// ClusterConfig follows the KubeVirt and CDI CRs for the servers' TLS
	// settings: KubeVirtTLS for the webhooks and the aggregated APIs
	// (virt-api's), CDITLS for the upload API and proxy (CDI's).
	ClusterConfig       *crwatch.Watch
	KubeVirtTLS, CDITLS *tlsprofile.Live
	// CPUModels are the KubeVirt CR's default and obsolete CPU models, for
	// the VMIs the VM controller creates.
	CPUModels *live.Value[cpumodel.Cluster]
	// MemoryOvercommit is the KubeVirt CR's memory overcommit, for the
	// VMIs the VM controller creates.
	MemoryOvercommit *live.Value[overcommit.Memory]
	// Rollout is the KubeVirt CR's hotplug gates, for the VM controller
	// and the subresources.
	Rollout *live.Value[rollout.Cluster]

	// scheduler is the leader's scheduler once built, for the VM
	// controller's placements before creation.
	scheduler *scheduler.Scheduler
	// ssp is the leader's common-templates role once built; the hco role
	// probes it for the SSP child.
	ssp *ssp.Role
	// vms and vmis are the informers of all VMs and VMIs the leader's
	// roles share (the VM controller, the scheduler, the MAC reconciler):
	// one watch and one cache of each instead of one per role. Each term
	// of leadership has its own (see leaderTerm); vmis is the term's view
	// of allVMIs.
	vms, vmis cache.SharedIndexInformer
	// allVMIs is the informer of all VMIs that lives as long as the brain,
	// which Brain.Run runs: the metrics server reads it on every brain,
	// the leader's roles through their term's view.
	allVMIs cache.SharedIndexInformer
	// nodes is the informer of all Nodes the leader's roles share (the
	// scheduler, node failure, evacuation, hco, the HostPathProvisioner
	// status): every node's heartbeat is decoded once, not once per role,
	// and no role lists the Nodes to look at them.
	nodes cache.SharedIndexInformer
	// leases is the informer of the node Leases (node failure's): each
	// renewal is read from its watch, not from a list of every Lease.
	leases cache.SharedIndexInformer
}

// Role is one job of the brain.
type Role = daemon.Role

// RoleFactory builds a role from the brain's dependencies.
type RoleFactory func(d *Deps) (Role, error)

// Brain is a running cluster brain.
type Brain struct {
	cfg    Config
	deps   *Deps
	always []Role // run on every brain (webhooks, aggregated APIs)
	leader []Role // run only on the leader (controllers), first term
	// termInformers are the shared informers of the latest leaderTerm.
	termInformers []cache.SharedIndexInformer
}

// New validates cfg and builds the brain with its roles.
func New(cfg Config) (*Brain, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rc, err := restConfig(cfg.Kubeconfig)
	if err != nil {
		return nil, err
	}
	rc.QPS, rc.Burst = 200, 400
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	virt, err := client.NewSet(rc)
	if err != nil {
		return nil, err
	}
	d := &Deps{Config: cfg, RestConfig: rc, Kube: kube, Virt: virt, Log: cfg.Log, allVMIs: virt.VMIs.Informer("", 0, nil),
		Health: daemon.NewHealth("api-installed"), ClusterConfig: crwatch.New(virt, cfg.Namespace),
		KubeVirtTLS: tlsprofile.NewLive(), CDITLS: tlsprofile.NewLive(), CPUModels: &live.Value[cpumodel.Cluster]{},
		MemoryOvercommit: &live.Value[overcommit.Memory]{}, Rollout: &live.Value[rollout.Cluster]{}}
	tlsprofile.Follow(d.ClusterConfig, d.KubeVirtTLS, d.CDITLS, d.Log)
	d.CDILog = d.Log
	if cfg.LogLevel != nil {
		logverbosity.Follow(d.ClusterConfig, cfg.LogLevel, logverbosity.Brain, d.Log)
		d.CDILog = logverbosity.CDIRoles(d.ClusterConfig, d.Log)
	}
	d.ClusterConfig.OnKubeVirt(func(kv *kubevirtv1.KubeVirt) {
		d.CPUModels.Set(cpumodel.FromKubeVirt(kv))
		d.MemoryOvercommit.Set(overcommit.FromKubeVirt(kv))
		d.Rollout.Set(rollout.FromKubeVirt(kv))
	})
	b := &Brain{cfg: cfg, deps: d}
	if b.always, err = build(everyBrainRoles, d); err != nil {
		return nil, err
	}
	b.always = append(b.always, d.ClusterConfig)
	// The first term's roles are built here, so that a configuration
	// error shows before the brain campaigns.
	if b.leader, err = b.leaderTerm(); err != nil {
		return nil, err
	}
	return b, nil
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		return rest.InClusterConfig()
	}
	return clientcmd.BuildConfigFromFlags("", kubeconfig)
}

func build(factories []RoleFactory, d *Deps) ([]Role, error) {
	var roles []Role
	for _, f := range factories {
		r, err := f(d)
		if err != nil {
			return nil, err
		}
		roles = append(roles, r)
	}
	return roles, nil
}

// leaderTerm builds the leader's roles for one term of leadership, with
// shared informers of their own: roles and informers stop with the term
// that ran them and cannot run again, so a brain that lost the lease and
// wins it back leads with new ones.
func (b *Brain) leaderTerm() ([]Role, error) {
	d := *b.deps
	d.scheduler = nil
	d.vms, d.vmis = d.Virt.VMs.Informer("", 0, nil), newTermInformer(d.allVMIs)
	d.nodes = coreinformers.NewNodeInformer(d.Kube, 0, cache.Indexers{})
	d.leases = nodefailure.NewLeaseInformer(d.Kube)
	roles, err := build(leaderRoles, &d)
	if err != nil {
		return nil, err
	}
	b.termInformers = []cache.SharedIndexInformer{d.vms, d.vmis, d.nodes, d.leases}
	return roles, nil
}

// Run installs the API, then runs the roles until ctx ends.
func (b *Brain) Run(ctx context.Context) error {
	log := b.cfg.Log
	errc := make(chan error, 1)
	go func() { errc <- daemon.Serve(ctx, b.cfg.HealthAddr, b.deps.Health.Handler(), log) }()
	if err := b.install(ctx); err != nil {
		return err
	}
	b.deps.Health.Set("api-installed", nil)
	_ = daemon.Notify("READY=1")
	go daemon.Watchdog(ctx, b.deps.Health.Ready)

	// groups and terms (of leadership so far) change in the leader
	// callback's goroutine.
	var mu sync.Mutex
	go b.deps.allVMIs.RunWithContext(ctx)
	groups := []*sync.WaitGroup{daemon.Start(ctx, log, b.deps.Health, b.always...)}
	terms := 0
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: b.cfg.Namespace, Name: "nodevirt-clusterbrain"},
		Client:     b.deps.Kube.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: b.cfg.Identity},
	}
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   b.cfg.LeaseDuration,
		RenewDeadline:   b.cfg.LeaseDuration * 2 / 3,
		RetryPeriod:     b.cfg.LeaseDuration / 5,
		ReleaseOnCancel: true,
		Name:            "nodevirt-clusterbrain",
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				mu.Lock()
				defer mu.Unlock()
				log.Info("leading", "identity", b.cfg.Identity, "term", terms+1)
				roles := b.leader
				if terms > 0 {
					var err error
					if roles, err = b.leaderTerm(); err != nil {
						log.Error("leader roles", "err", err)
						return
					}
				}
				terms++
				for _, inf := range b.termInformers {
					go inf.RunWithContext(ctx)
				}
				groups = append(groups, daemon.Start(ctx, log, nil, roles...))
			},
			OnStoppedLeading: func() { log.Info("stopped leading", "identity", b.cfg.Identity) },
			OnNewLeader: func(id string) {
				if id != b.cfg.Identity {
					log.Info("following", "leader", id)
				}
			},
		},
	})
	if err != nil {
		return err
	}
	// Keep campaigning after a lost lease until shutdown.
	for ctx.Err() == nil {
		le.Run(ctx)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, g := range groups {
		g.Wait()
	}
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}

// install is the virt-operator install role: namespace and CRDs.
func (b *Brain) install(ctx context.Context) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: b.cfg.Namespace}}
	if _, err := b.deps.Kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", b.cfg.Namespace, err)
	}
	ext, err := apiextensionsclient.NewForConfig(b.deps.RestConfig)
	if err != nil {
		return err
	}
	if err := crds.Install(ctx, ext, crds.Catalog()); err != nil {
		return fmt.Errorf("install crds: %w", err)
	}
	// The snapshot API is the cluster's when it has one (external-snapshotter);
	// else the brain installs it, so nodes can take and restore snapshots.
	if err := crds.InstallAbsent(ctx, ext, crds.SnapshotCatalog()); err != nil {
		return fmt.Errorf("install snapshot crds: %w", err)
	}
	b.cfg.Log.Info("api installed", "kinds", len(crds.Catalog()))
	return nil
}
