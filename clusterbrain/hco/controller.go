// Package hco is the HyperConverged reconciliation role of the cluster brain
// (upstream's hyperconverged-cluster-operator): it defaults the singleton
// HyperConverged CR, renders the KubeVirt, CDI, NetworkAddonsConfig, SSP and
// HostPathProvisioner CRs from it, reverts manual edits of those children,
// reports each child's status (nodevirt runs no separate operators) and
// aggregates one platform status. webhook.go holds the hco-webhook's
// admission functions.
package hco

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// Finalizer keeps the HyperConverged until its cluster-scoped children are
// removed (they cannot carry an ownerReference to a namespaced owner).
const Finalizer = "kubevirt.io/hyperconverged"

// Config configures the role.
type Config struct {
	// Namespace is where the singleton HyperConverged lives.
	Namespace string
	Kube      kubernetes.Interface
	Virt      *client.Set
	Log       *slog.Logger
	// Version is reported in status.versions and the children's labels
	// (default: the binary's module version, else "devel").
	Version string
	// BrainHealth reports this brain's own readiness checks; a failing one
	// makes the platform Degraded. Nil means healthy.
	BrainHealth func() error
	// Resync re-reconciles periodically (default 5m).
	Resync time.Duration
	// Probes check, per child kind ("CDI", "NetworkAddonsConfig", "SSP",
	// "HostPathProvisioner", "KubeVirt"), the brain's parts the child
	// stands for; a failing one makes the child unavailable, naming it.
	// The node agents are judged from their Nodes without a probe. Nil:
	// the brain's parts are not checked.
	Probes map[string][]Probe
	// ProbeEvery re-reconciles this often while Probes are set, since
	// nothing watched signals a role stopping (default 30s).
	ProbeEvery time.Duration
	// BrainDeployment names the brain's own Deployment in Namespace,
	// which spec.infra.nodePlacement places (placeBrain); empty: the brain
	// is not run by a Deployment and the infra placement places nothing.
	BrainDeployment string
	// Nodes is the brain's shared informer of every Node, from whose
	// cache the node agents are judged; nil: the role runs one of its own.
	Nodes cache.SharedIndexInformer
}

func (c *Config) defaults() {
	if c.Namespace == "" {
		c.Namespace = hcov1beta1.DefaultNamespace
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Version == "" {
		c.Version = moduleVersion()
	}
	if c.Resync == 0 {
		c.Resync = 5 * time.Minute
	}
	if c.ProbeEvery == 0 {
		c.ProbeEvery = 30 * time.Second
	}
}

func (c *Config) validate() error {
	if c.Kube == nil || c.Virt == nil {
		return errors.New("hco: kube and virt clients are required")
	}
	if errs := validation.IsValidLabelValue(c.Version); len(errs) > 0 {
		return fmt.Errorf("hco: version %q is not a label value: %v", c.Version, errs)
	}
	return nil
}

func moduleVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && len(validation.IsValidLabelValue(bi.Main.Version)) == 0 && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "devel"
}

// Controller is the HyperConverged reconciliation role.
type Controller struct {
	cfg         Config
	queue       *controller.Queue
	recorder    *controller.Recorder
	overwritten *metrics.CounterVec

	mu          sync.Mutex
	lastApplied map[string]string // child kind → hash of the spec last written
	reverts     map[string]int    // child kind → out-of-band edits reverted
	// probesFailing says the last reconcile found a part missing: the
	// next probe comes sooner.
	probesFailing bool
	nodes         controller.Shared
	// unplacedLogged: the infra placement a brain without a Deployment
	// cannot apply was logged (once per run; syncs run on one worker).
	unplacedLogged bool
}

// New validates cfg and builds the role.
func New(cfg Config) (*Controller, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg:         cfg,
		recorder:    controller.NewRecorder(client.NewScheme(), "nodevirt-hco"),
		overwritten: outOfBand,
		lastApplied: map[string]string{},
		reverts:     map[string]int{},
		nodes:       controller.SharedNodes(cfg.Kube, cfg.Nodes),
	}
	var err error
	c.queue, err = controller.New(controller.Config{Name: "hyperconverged", Backoff: controller.BackoffAPI, Log: cfg.Log,
		Sync: func(ctx context.Context, key string) (time.Duration, error) {
			ns, name, _ := cache.SplitMetaNamespaceKey(key)
			return c.Sync(ctx, ns, name)
		},
		Observe: func(err error) { metrics.Reconciled("hyperconverged", err) }})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Name implements the brain's Role.
func (c *Controller) Name() string { return "hco" }

// Reverts returns how many manual edits of each child kind were reverted.
func (c *Controller) Reverts() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.reverts))
	for k, v := range c.reverts {
		out[k] = v
	}
	return out
}

func (c *Controller) singletonKey() string { return c.cfg.Namespace + "/" + hcov1beta1.Name }

// Run watches the HyperConverged CRs, the children and the Nodes, and
// reconciles until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer c.queue.ShutDown()
	defer c.recorder.Start(c.cfg.Kube)()

	toSingleton := controller.OnChange(func(any) { c.queue.Add(c.singletonKey()) })
	v, ns, rs := c.cfg.Virt, c.cfg.Namespace, c.cfg.Resync
	hcoInf := v.HyperConvergeds.Informer("", rs, nil)
	if _, err := hcoInf.AddEventHandler(controller.OnChange(c.queue.Enqueue)); err != nil {
		return err
	}
	infs := []cache.SharedIndexInformer{hcoInf,
		v.KubeVirts.Informer(ns, rs, nil), v.SSPs.Informer(ns, rs, nil),
		v.CDIs.Informer("", rs, nil), v.NetworkAddonsConfigs.Informer("", rs, nil), v.HostPathProvisioners.Informer("", rs, nil),
	}
	for _, inf := range infs[1:] {
		if _, err := inf.AddEventHandler(toSingleton); err != nil {
			return err
		}
	}
	onNodes := toSingleton
	onNodes.UpdateFunc = func(old, obj any) {
		if nodeHealthChanged(old, obj) {
			c.queue.Add(c.singletonKey())
		}
	}
	// Only the node agents' Nodes count: another Node coming, going or
	// changing changes nothing of the status.
	if _, err := c.nodes.AddEventHandler(cache.FilteringResourceEventHandler{FilterFunc: isNodeAgent, Handler: onNodes}); err != nil {
		return err
	}
	c.nodes.RunOwn(ctx)
	synced := []cache.InformerSynced{c.nodes.HasSynced}
	for _, inf := range infs {
		go inf.RunWithContext(ctx)
		synced = append(synced, inf.HasSynced)
	}
	c.queue.Add(c.singletonKey()) // the first sync, once the caches are filled
	if err := c.queue.Run(ctx, synced...); err != nil {
		return ctx.Err()
	}
	return nil
}

// Sync reconciles one HyperConverged; a positive duration asks to be
// called again after it (waiting on something nothing watched signals).
func (c *Controller) Sync(ctx context.Context, ns, name string) (time.Duration, error) {
	log := c.cfg.Log.With("namespace", ns, "name", name)
	hc, err := c.cfg.Virt.HyperConvergeds.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("get hyperconverged: %w", err)
	}
	if ns != c.cfg.Namespace || name != hcov1beta1.Name {
		return 0, c.refuse(ctx, hc)
	}
	if hc.DeletionTimestamp != nil {
		return c.uninstall(ctx, hc, log)
	}
	if hc, err = c.prepare(ctx, hc, log); err != nil {
		return 0, err
	}
	children, err := Render(hc, c.cfg.Version)
	if err != nil {
		log.Warn("render children", "err", err)
		return 0, c.writeStatus(ctx, hc, failedReconcile(reasonInvalidConfig, err.Error()), nil)
	}
	var brainErr error
	if c.cfg.BrainHealth != nil {
		brainErr = c.cfg.BrainHealth()
	}
	related, health, err := c.reconcileChildren(ctx, hc, children, nodeHealthOf(c.nodeList()))
	if err != nil {
		return 0, err
	}
	// Retried with back-off, after the status is written.
	placeErr := c.placeBrain(ctx, hc, log)
	var again time.Duration
	if len(c.cfg.Probes) > 0 {
		again = c.cfg.ProbeEvery
		c.mu.Lock()
		if c.probesFailing && again > 5*time.Second {
			again = 5 * time.Second
		}
		c.mu.Unlock()
	}
	return again, errors.Join(c.writeStatus(ctx, hc, aggregate(health, brainErr), related), placeErr)
}

// nodeList is every Node of the informer's cache (its own objects: read,
// never written).
func (c *Controller) nodeList() []*corev1.Node {
	var nodes []*corev1.Node
	for _, o := range c.nodes.GetStore().List() {
		if n, ok := o.(*corev1.Node); ok {
			nodes = append(nodes, n)
		}
	}
	return nodes
}

// refuse marks a HyperConverged that is not the singleton, rendering
// nothing for it.
func (c *Controller) refuse(ctx context.Context, hc *hcov1beta1.HyperConverged) error {
	msg := fmt.Sprintf(messageInvalidRequest, hcov1beta1.Name, c.cfg.Namespace)
	s := conditionSet{hcov1beta1.ConditionReconcileComplete: {Type: hcov1beta1.ConditionReconcileComplete,
		Status: metav1.ConditionFalse, Reason: reasonInvalidRequest, Message: msg}}
	return c.writeStatus(ctx, hc, s, nil)
}

// prepare writes upstream's defaults, the app label and the finalizer into
// the CR when missing, and returns the stored object.
func (c *Controller) prepare(ctx context.Context, hc *hcov1beta1.HyperConverged, log *slog.Logger) (*hcov1beta1.HyperConverged, error) {
	want := hc.DeepCopyObject().(*hcov1beta1.HyperConverged)
	changed := SetDefaults(want)
	if want.Labels[LabelApp] == "" {
		if want.Labels == nil {
			want.Labels = map[string]string{}
		}
		want.Labels[LabelApp] = want.Name
		changed = true
	}
	if !slices.Contains(want.Finalizers, Finalizer) {
		want.Finalizers = append(want.Finalizers, Finalizer)
		changed = true
	}
	if !changed {
		return hc, nil
	}
	if hc.Status.Conditions == nil {
		c.recorder.Event(hc, corev1.EventTypeNormal, "InitHCO", "Initiating the HyperConverged")
	}
	out, err := c.cfg.Virt.HyperConvergeds.Update(ctx, want)
	if err != nil {
		return nil, fmt.Errorf("write defaults: %w", err)
	}
	log.Info("defaulted hyperconverged", "generation", out.Generation)
	return out, nil
}

// writeStatus applies the conditions, related objects, versions and
// observed generation, writing the status only when it changed.
func (c *Controller) writeStatus(ctx context.Context, hc *hcov1beta1.HyperConverged, s conditionSet, related []corev1.ObjectReference) error {
	want := hc.DeepCopyObject().(*hcov1beta1.HyperConverged)
	wasAvailable := isTrue(hc.Status.Conditions, hcov1beta1.ConditionAvailable)
	applyConditions(want, s)
	if related != nil {
		want.Status.RelatedObjects = related
	}
	want.Status.Versions = []hcov1beta1.Version{{Name: "operator", Version: c.cfg.Version}}
	want.Status.ObservedGeneration = hc.Generation
	want.Status.InfrastructureHighlyAvailable = nil
	if equalStatus(hc.Status, want.Status) {
		return nil
	}
	if _, err := c.cfg.Virt.HyperConvergeds.UpdateStatus(ctx, want); err != nil {
		return fmt.Errorf("update hyperconverged status: %w", err)
	}
	nowAvailable := isTrue(want.Status.Conditions, hcov1beta1.ConditionAvailable)
	switch {
	case nowAvailable && !wasAvailable:
		c.recorder.Event(hc, corev1.EventTypeNormal, "ReconcileHCO", "HCO Reconcile completed successfully")
	case !nowAvailable && wasAvailable:
		c.recorder.Event(hc, corev1.EventTypeWarning, "ReconcileHCO", "Not all the operators are ready")
	}
	return nil
}

func isTrue(conds []metav1.Condition, typ string) bool {
	for _, c := range conds {
		if c.Type == typ {
			return c.Status == metav1.ConditionTrue
		}
	}
	return false
}

func equalStatus(a, b hcov1beta1.HyperConvergedStatus) bool {
	if !sameConditions(a.Conditions, b.Conditions) {
		return false
	}
	a.Conditions, b.Conditions = nil, nil
	return jsonEqual(a, b)
}

// outOfBand counts the manual edits of children that reconciliation
// reverted, by kind, under upstream HCO's name; the brain's /metrics serves
// it.
var outOfBand = metrics.Default().Counter("kubevirt_hco_out_of_band_modifications_total",
	"Count of out-of-band modifications overwritten by the HyperConverged reconciliation.", "component_name")
