// Package migration is the brain's side of live migration: it drives each
// VirtualMachineInstanceMigration through KubeVirt's phases (Pending,
// Scheduling, Scheduled, PreparingTarget, TargetReady, Running, Succeeded or
// Failed) with the node agents of the source and the target node, as
// package migstate lays down.
//
// A migration whose VMI does not exist, does not run, is LiveMigratable
// False, or already has a migration under way fails at once with
// KubeVirt's words. Otherwise the scheduler picks a target node among those
// the VMI could be placed on (its nodeSelector, affinity and tolerations,
// plus the migration's addedNodeSelector, and room for its requests),
// never the source; the target holds the VMI's requests in the scheduler
// until the migration ends. When the source
// node reports the end, a successful migration moves the VMI to the target
// (its kubevirt.io/nodeName label and status.nodeName); either way the
// VMI's status.migrationState is the migration's. Deleting a migration that
// has not ended aborts it (abortRequested): the guest stays on the source.
// Draining nodes are emptied (evacuation.go); the claims of copied
// node-local disks follow the guest (claims.go).
package migration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// Event reasons (KubeVirt's words).
const (
	ReasonFailed    = "FailedMigration"
	ReasonSucceeded = "SuccessfulMigration"
	ReasonCreated   = "SuccessfulCreate"
	ReasonAborted   = "MigrationAborted"
)

// Placer picks the target node of a migration (the brain's scheduler); the
// controller cannot migrate without one.
type Placer interface {
	// DecideMigration returns a target node for vmi, given as the
	// migration must be placed (placementOf), with the scheduler's checks
	// and capacity count, and holds the VMI's requests on that node until
	// the migration records the target; the migration's targetNode holds
	// them from then until the migration ends.
	DecideMigration(vmi *kubevirtv1.VirtualMachineInstance) (string, error)
	// ReleaseMigration drops that hold when the migration could not
	// record the target.
	ReleaseMigration(vmi types.UID)
}

// Config configures the controller.
type Config struct {
	Kube   kubernetes.Interface
	Virt   *client.Set
	Placer Placer
	// Dynamic reads MigrationPolicies (policy.go); nil: none apply.
	Dynamic dynamic.Interface
	Log     *slog.Logger
	// Resync re-reads every migration this often (default 1 minute: the
	// target timeout is checked then).
	Resync time.Duration
	// TargetTimeout fails a migration whose target node has not got ready
	// in this time (default 5 minutes, KubeVirt's unschedulable target
	// pod timeout).
	TargetTimeout time.Duration
	// EvacuationInterval is how often draining nodes are looked at
	// (default 5 seconds; evacuation.go).
	EvacuationInterval time.Duration
	// Nodes is the brain's shared informer of every Node, where the
	// evacuation looks for draining nodes; nil: the controller runs one
	// of its own.
	Nodes cache.SharedIndexInformer
}

func (c *Config) defaults() {
	if c.Resync == 0 {
		c.Resync = time.Minute
	}
	if c.TargetTimeout == 0 {
		c.TargetTimeout = 5 * time.Minute
	}
	if c.EvacuationInterval == 0 {
		c.EvacuationInterval = 5 * time.Second
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	if c.Kube == nil || c.Virt == nil || c.Placer == nil {
		return errors.New("migration: Kube and Virt clients and a Placer are required")
	}
	return nil
}

// Controller drives VirtualMachineInstanceMigrations.
type Controller struct {
	cfg      Config
	log      *slog.Logger
	informer cache.SharedIndexInformer
	queue    *controller.Queue
	recorder *controller.Recorder
	// replacements are the claims being replaced (claims.go), by
	// namespace/name, kept from their deletion to their re-creation.
	replacements sync.Map
	// warned is when each VMI that cannot leave a draining node was last
	// told so (evacuation.go; its goroutine only).
	warned map[types.UID]time.Time
	nodes  controller.Shared
}

// New validates cfg and builds the controller; Run starts it.
func New(cfg Config) (*Controller, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg: cfg, log: cfg.Log.With("role", "migration"),
		informer: cfg.Virt.Migrations.Informer("", cfg.Resync, nil),
		recorder: controller.NewRecorder(client.NewScheme(), "nodevirt-migration"),
		warned:   map[types.UID]time.Time{},
	}
	c.nodes = controller.SharedNodes(cfg.Kube, cfg.Nodes)
	var err error
	c.queue, err = controller.New(controller.Config{Name: "migrations", Sync: controller.NoRequeue(c.sync),
		Backoff: controller.BackoffAPI, Log: c.log, KeyAttr: "migration",
		Observe: func(err error) { metrics.Reconciled("migration", err) }})
	if err != nil {
		return nil, err
	}
	_, _ = c.informer.AddEventHandler(controller.OnAddOrUpdate(c.queue.Enqueue))
	_, _ = c.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{UpdateFunc: observeTransitions})
	return c, nil
}

// Name names the role.
func (c *Controller) Name() string { return "migration" }

// Run serves until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer c.recorder.Start(c.cfg.Kube)()
	go c.informer.RunWithContext(ctx)
	c.nodes.RunOwn(ctx)
	c.log.Info("started")
	go c.evacuate(ctx, c.cfg.EvacuationInterval)
	return c.queue.Run(ctx, c.informer.HasSynced)
}

func (c *Controller) sync(ctx context.Context, key string) error {
	obj, exists, err := c.informer.GetIndexer().GetByKey(key)
	if err != nil || !exists {
		return err
	}
	mig := obj.(*kubevirtv1.VirtualMachineInstanceMigration)
	vmi, err := c.cfg.Virt.VMIs.Get(ctx, mig.Namespace, mig.Spec.VMIName)
	if apierrors.IsNotFound(err) {
		vmi, err = nil, nil
	}
	if err != nil {
		return fmt.Errorf("vmi %s/%s: %w", mig.Namespace, mig.Spec.VMIName, err)
	}
	st := mig.Status.MigrationState
	switch {
	case migstate.Final(mig):
		if mig.Status.Phase == kubevirtv1.MigrationSucceeded && vmi != nil && vmi.Status.NodeName == st.TargetNode {
			done, err := c.moveClaims(ctx, mig, vmi)
			if err != nil {
				return err
			}
			if !done {
				c.queue.AddAfter(key, time.Second)
				return nil
			}
		}
		if mig.DeletionTimestamp != nil {
			return c.dropFinalizer(ctx, mig)
		}
		return nil
	case migstate.Ended(st):
		return c.settle(ctx, mig, vmi)
	case mig.DeletionTimestamp != nil:
		return c.abort(ctx, mig, vmi)
	case mig.Status.Phase == "" || mig.Status.Phase == kubevirtv1.MigrationPending:
		return c.schedule(ctx, mig, vmi)
	case vmi == nil || (st != nil && vmi.UID != "" && vmi.Status.NodeName != st.SourceNode):
		return c.fail(ctx, mig, vmi, "the VMI is gone or left the source node during the migration")
	}
	next := mig.Status.Phase
	switch {
	case st.StartTimestamp != nil:
		next = kubevirtv1.MigrationRunning
	case st.TargetNodeAddress != "":
		next = kubevirtv1.MigrationTargetReady
	case since(mig, kubevirtv1.MigrationPreparingTarget) > c.cfg.TargetTimeout:
		return c.fail(ctx, mig, vmi, fmt.Sprintf("target node %s was not ready within %s", st.TargetNode, c.cfg.TargetTimeout))
	}
	if next == mig.Status.Phase {
		return nil
	}
	return c.setPhase(ctx, mig, vmi, next)
}

// schedule checks the VMI and picks the target node.
func (c *Controller) schedule(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) error {
	if !slices.Contains(mig.Finalizers, migstate.Finalizer) || mig.Labels[kubevirtv1.MigrationSelectorLabel] != mig.Spec.VMIName {
		// KubeVirt's finalizer, and the label its webhook sets (what
		// `virtctl migrate-cancel` finds the migration of a VMI by).
		upd := mig.DeepCopy()
		if !slices.Contains(upd.Finalizers, migstate.Finalizer) {
			upd.Finalizers = append(upd.Finalizers, migstate.Finalizer)
		}
		if upd.Labels == nil {
			upd.Labels = map[string]string{}
		}
		upd.Labels[kubevirtv1.MigrationSelectorLabel] = mig.Spec.VMIName
		if _, err := c.cfg.Virt.Migrations.Update(ctx, upd); err != nil {
			return fmt.Errorf("migration %s/%s finalizer: %w", mig.Namespace, mig.Name, err)
		}
		return nil // the update queues it again
	}
	if why := Refusal(vmi, mig.Spec.VMIName); why != "" {
		return c.fail(ctx, mig, vmi, why)
	}
	if other := c.inFlight(mig, vmi); other != "" {
		return c.fail(ctx, mig, vmi, fmt.Sprintf("in-flight migration detected: migration %s of VMI %s is under way", other, vmi.Name))
	}
	source := vmi.Status.NodeName
	conf, err := c.configuration(ctx)
	if err != nil {
		return err
	}
	if why := c.overLimit(mig, source, conf); why != "" {
		// Pending until another migration ends (that one's update
		// queues this again; the resync as well).
		c.log.Info("migration waits", "migration", mig.Namespace+"/"+mig.Name, "reason", why)
		if mig.Status.Phase == "" {
			out := mig.DeepCopy()
			addPhase(out, kubevirtv1.MigrationPending, metav1.Now())
			if _, err := c.cfg.Virt.Migrations.UpdateStatus(ctx, out); err != nil {
				return fmt.Errorf("migration %s/%s status: %w", mig.Namespace, mig.Name, err)
			}
		}
		c.queue.AddAfter(mig.Namespace+"/"+mig.Name, 5*time.Second)
		return nil
	}
	policies, err := c.policies(ctx)
	if err != nil {
		return err
	}
	var policyName *string
	if len(policies) > 0 {
		ns, err := c.cfg.Kube.CoreV1().Namespaces().Get(ctx, vmi.Namespace, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("namespace %s: %w", vmi.Namespace, err)
		}
		if p := MatchPolicy(policies, vmi.Labels, ns.Labels); p != nil {
			applyPolicy(conf, p)
			name := p.Name
			policyName = &name
		}
	}
	target, err := c.cfg.Placer.DecideMigration(placementOf(vmi, mig))
	if err != nil {
		return c.fail(ctx, mig, vmi, fmt.Sprintf("no node to migrate VMI %s to: %v", vmi.Name, err))
	}
	if target == source {
		c.cfg.Placer.ReleaseMigration(vmi.UID)
		return c.fail(ctx, mig, vmi, "the scheduler chose the source node "+source)
	}
	out := mig.DeepCopy()
	now := metav1.Now()
	for _, p := range []kubevirtv1.VirtualMachineInstanceMigrationPhase{kubevirtv1.MigrationPending, kubevirtv1.MigrationScheduling,
		kubevirtv1.MigrationScheduled, kubevirtv1.MigrationPreparingTarget} {
		addPhase(out, p, now)
	}
	out.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{
		MigrationUID: mig.UID, SourceNode: source, TargetNode: target, Mode: kubevirtv1.MigrationPreCopy,
		VMIMConfigurationOptions: conf, MigrationPolicyName: policyName,
	}
	if _, err := c.cfg.Virt.Migrations.UpdateStatus(ctx, out); err != nil {
		c.cfg.Placer.ReleaseMigration(vmi.UID)
		return fmt.Errorf("migration %s/%s status: %w", mig.Namespace, mig.Name, err)
	}
	if err := c.mirror(ctx, vmi, out.Status.MigrationState, ""); err != nil {
		return err
	}
	c.recorder.Eventf(mig, corev1.EventTypeNormal, ReasonCreated, "Migrating VMI %s from node %s to node %s", vmi.Name, source, target)
	c.log.Info("migration scheduled", "migration", mig.Namespace+"/"+mig.Name, "vmi", vmi.Name, "source", source, "target", target)
	return nil
}

// placementOf is the VMI as the scheduler should place its migration: the
// migration's addedNodeSelector on top of its own, the source node
// excluded, and without its volumes (node-local disks are copied, so they
// do not hold the VMI on their node).
func placementOf(vmi *kubevirtv1.VirtualMachineInstance, mig *kubevirtv1.VirtualMachineInstanceMigration) *kubevirtv1.VirtualMachineInstance {
	p := vmi.DeepCopy()
	p.Spec.Volumes = nil
	p.Spec.Domain.Devices.Disks = nil
	if len(mig.Spec.AddedNodeSelector) > 0 {
		sel := maps.Clone(p.Spec.NodeSelector)
		if sel == nil {
			sel = map[string]string{}
		}
		maps.Copy(sel, mig.Spec.AddedNodeSelector)
		p.Spec.NodeSelector = sel
	}
	notSource := corev1.NodeSelectorRequirement{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpNotIn,
		Values: []string{vmi.Status.NodeName}}
	if p.Spec.Affinity == nil {
		p.Spec.Affinity = &corev1.Affinity{}
	}
	if p.Spec.Affinity.NodeAffinity == nil {
		p.Spec.Affinity.NodeAffinity = &corev1.NodeAffinity{}
	}
	na := p.Spec.Affinity.NodeAffinity
	if na.RequiredDuringSchedulingIgnoredDuringExecution == nil || len(na.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms) == 0 {
		na.RequiredDuringSchedulingIgnoredDuringExecution = &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{}}}
	}
	for i := range na.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		t := &na.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[i]
		t.MatchExpressions = append(t.MatchExpressions, notSource)
	}
	return p
}

// configuration is the migrations block of the KubeVirt CR (HCO's
// liveMigrationConfig) with KubeVirt's defaults filled in: what the source
// node applies, recorded on the migration.
func (c *Controller) configuration(ctx context.Context) (*kubevirtv1.VMIMConfigurationOptions, error) {
	kvs, err := c.cfg.Virt.KubeVirts.List(ctx, metav1.NamespaceAll, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("kubevirt configuration: %w", err)
	}
	conf := &kubevirtv1.VMIMConfigurationOptions{}
	for _, kv := range kvs {
		if mc := kv.Spec.Configuration.MigrationConfiguration; mc != nil {
			// The same fields under the same JSON names.
			b, err := json.Marshal(mc)
			if err == nil {
				err = json.Unmarshal(b, conf)
			}
			if err != nil {
				return nil, fmt.Errorf("kubevirt %s migrations: %w", kv.Name, err)
			}
			break
		}
	}
	return Defaulted(conf), nil
}

// Defaulted fills KubeVirt's defaults into conf.
func Defaulted(conf *kubevirtv1.VMIMConfigurationOptions) *kubevirtv1.VMIMConfigurationOptions {
	def := func(p **int64, v int64) {
		if *p == nil {
			*p = &v
		}
	}
	defU := func(p **uint32, v uint32) {
		if *p == nil {
			*p = &v
		}
	}
	defB := func(p **bool) {
		if *p == nil {
			f := false
			*p = &f
		}
	}
	def(&conf.CompletionTimeoutPerGiB, 150)
	def(&conf.ProgressTimeout, 150)
	defU(&conf.ParallelMigrationsPerCluster, 5)
	defU(&conf.ParallelOutboundMigrationsPerNode, 2)
	defB(&conf.AllowAutoConverge)
	defB(&conf.AllowPostCopy)
	if conf.BandwidthPerMigration == nil {
		q := resource.MustParse("0Mi")
		conf.BandwidthPerMigration = &q
	}
	if conf.NodeDrainTaintKey == nil {
		k := DefaultDrainTaintKey
		conf.NodeDrainTaintKey = &k
	}
	return conf
}

// overLimit says why the migration must wait: the cluster's or the source
// node's parallel migrations are all taken.
func (c *Controller) overLimit(mig *kubevirtv1.VirtualMachineInstanceMigration, source string, conf *kubevirtv1.VMIMConfigurationOptions) string {
	cluster, outbound := 0, 0
	for _, o := range c.informer.GetIndexer().List() {
		m := o.(*kubevirtv1.VirtualMachineInstanceMigration)
		if m.UID == mig.UID || migstate.Final(m) || m.Status.MigrationState == nil || m.Status.MigrationState.TargetNode == "" {
			continue
		}
		cluster++
		if m.Status.MigrationState.SourceNode == source {
			outbound++
		}
	}
	switch {
	case cluster >= int(*conf.ParallelMigrationsPerCluster):
		return fmt.Sprintf("%d migrations run in the cluster (parallelMigrationsPerCluster)", cluster)
	case outbound >= int(*conf.ParallelOutboundMigrationsPerNode):
		return fmt.Sprintf("%d migrations leave node %s (parallelOutboundMigrationsPerNode)", outbound, source)
	}
	return ""
}

// inFlight names another migration of the same VMI that has not ended.
func (c *Controller) inFlight(mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) string {
	for _, o := range c.informer.GetIndexer().List() {
		m := o.(*kubevirtv1.VirtualMachineInstanceMigration)
		if m.UID == mig.UID || m.Namespace != mig.Namespace || m.Spec.VMIName != vmi.Name || migstate.Final(m) {
			continue
		}
		if m.Status.MigrationState != nil && m.Status.MigrationState.SourceNode != "" {
			return m.Name
		}
	}
	return ""
}

// setPhase records the next phase on the migration and the VMI.
func (c *Controller) setPhase(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance,
	phase kubevirtv1.VirtualMachineInstanceMigrationPhase) error {
	out := mig.DeepCopy()
	if phase == kubevirtv1.MigrationRunning && out.Status.Phase == kubevirtv1.MigrationPreparingTarget {
		addPhase(out, kubevirtv1.MigrationTargetReady, metav1.Now())
	}
	addPhase(out, phase, metav1.Now())
	if _, err := c.cfg.Virt.Migrations.UpdateStatus(ctx, out); err != nil {
		return fmt.Errorf("migration %s/%s status: %w", mig.Namespace, mig.Name, err)
	}
	return c.mirror(ctx, vmi, out.Status.MigrationState, "")
}

// settle ends a migration the nodes reported ended: a success moves the
// VMI to the target node.
func (c *Controller) settle(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) error {
	st := mig.Status.MigrationState.DeepCopy()
	st.Completed = true
	if st.EndTimestamp == nil {
		now := metav1.Now()
		st.EndTimestamp = &now
	}
	if vmi != nil && !st.Failed {
		if err := c.mirror(ctx, vmi, st, st.TargetNode); err != nil {
			return err
		}
	} else if vmi != nil {
		if err := c.mirror(ctx, vmi, st, ""); err != nil {
			return err
		}
	}
	out := mig.DeepCopy()
	out.Status.MigrationState = st
	phase := kubevirtv1.MigrationSucceeded
	if st.Failed {
		phase = kubevirtv1.MigrationFailed
	}
	addPhase(out, phase, metav1.Now())
	if _, err := c.cfg.Virt.Migrations.UpdateStatus(ctx, out); err != nil {
		return fmt.Errorf("migration %s/%s status: %w", mig.Namespace, mig.Name, err)
	}
	switch {
	case st.Failed && st.AbortStatus == kubevirtv1.MigrationAbortSucceeded:
		c.recorder.Eventf(mig, corev1.EventTypeNormal, ReasonAborted, "Migration of VMI %s aborted; it runs on node %s", mig.Spec.VMIName, st.SourceNode)
	case st.Failed:
		c.recorder.Eventf(mig, corev1.EventTypeWarning, ReasonFailed, "Migration of VMI %s failed: %s", mig.Spec.VMIName, st.FailureReason)
	default:
		c.recorder.Eventf(mig, corev1.EventTypeNormal, ReasonSucceeded, "VMI %s migrated from node %s to node %s", mig.Spec.VMIName, st.SourceNode, st.TargetNode)
	}
	migrationsSettled.With(string(phase)).Inc()
	c.log.Info("migration ended", "migration", mig.Namespace+"/"+mig.Name, "phase", phase, "source", st.SourceNode,
		"target", st.TargetNode, "reason", st.FailureReason)
	return nil
}

var migrationsSettled = metrics.Default().Counter("kubevirt_vmi_migrations_settled_total",
	"VirtualMachineInstanceMigrations that ended, by phase.", "phase")

// transitionBuckets span a migration's phases from a second to an hour.
var transitionBuckets = []float64{0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600}

var phaseTransitions = metrics.Default().Histogram("kubevirt_vmi_migration_phase_transition_time_from_creation_seconds",
	"Histogram of VM migration phase transitions duration from creation time in seconds.", transitionBuckets, "phase")

// observeTransitions counts the phases a migration entered between two
// of its versions (whoever wrote them: the brain or a node agent), each
// by how long after the migration's creation.
func observeTransitions(oldObj, newObj any) {
	old, ok1 := oldObj.(*kubevirtv1.VirtualMachineInstanceMigration)
	m, ok2 := newObj.(*kubevirtv1.VirtualMachineInstanceMigration)
	if !ok1 || !ok2 {
		return
	}
	for _, t := range m.Status.PhaseTransitionTimestamps[min(len(old.Status.PhaseTransitionTimestamps), len(m.Status.PhaseTransitionTimestamps)):] {
		phaseTransitions.With(string(t.Phase)).Observe(t.PhaseTransitionTimestamp.Sub(m.CreationTimestamp.Time).Seconds())
	}
}

// abort asks the source to abort a deleted migration; one that never got a
// target ends at once.
func (c *Controller) abort(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) error {
	st := mig.Status.MigrationState
	if st == nil || st.TargetNode == "" {
		return c.dropFinalizer(ctx, mig)
	}
	if st.AbortRequested {
		return nil
	}
	if err := migstate.UpdateState(ctx, c.cfg.Virt, mig.Namespace, mig.Name, func(_ *kubevirtv1.VirtualMachineInstanceMigration, s *kubevirtv1.VirtualMachineInstanceMigrationState) bool {
		if s.AbortRequested {
			return false
		}
		s.AbortRequested, s.AbortStatus = true, kubevirtv1.MigrationAbortInProgress
		return true
	}); err != nil {
		return err
	}
	c.log.Info("migration abort requested", "migration", mig.Namespace+"/"+mig.Name)
	if vmi != nil {
		st = st.DeepCopy()
		st.AbortRequested, st.AbortStatus = true, kubevirtv1.MigrationAbortInProgress
		return c.mirror(ctx, vmi, st, "")
	}
	return nil
}

func (c *Controller) dropFinalizer(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration) error {
	if !slices.Contains(mig.Finalizers, migstate.Finalizer) {
		return nil
	}
	out := mig.DeepCopy()
	out.Finalizers = slices.DeleteFunc(out.Finalizers, func(f string) bool { return f == migstate.Finalizer })
	if _, err := c.cfg.Virt.Migrations.Update(ctx, out); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("migration %s/%s finalizer: %w", mig.Namespace, mig.Name, err)
	}
	return nil
}

// fail ends the migration Failed with why, as KubeVirt's status shows it.
// The nodes remove what they made for it.
func (c *Controller) fail(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance, why string) error {
	out := mig.DeepCopy()
	now := metav1.Now()
	addPhase(out, kubevirtv1.MigrationFailed, now)
	st := out.Status.MigrationState
	if st == nil {
		st = &kubevirtv1.VirtualMachineInstanceMigrationState{MigrationUID: mig.UID, StartTimestamp: &now}
		if vmi != nil {
			st.SourceNode = vmi.Status.NodeName
		}
		out.Status.MigrationState = st
	}
	st.EndTimestamp, st.Completed, st.Failed, st.FailureReason = &now, true, true, why
	if _, err := c.cfg.Virt.Migrations.UpdateStatus(ctx, out); err != nil {
		return fmt.Errorf("migration %s/%s status: %w", mig.Namespace, mig.Name, err)
	}
	if vmi != nil && st.TargetNode != "" {
		if err := c.mirror(ctx, vmi, st, ""); err != nil {
			return err
		}
	}
	migrationsSettled.With(string(kubevirtv1.MigrationFailed)).Inc()
	c.recorder.Event(mig, corev1.EventTypeWarning, ReasonFailed, why)
	c.log.Info("migration failed", "migration", mig.Namespace+"/"+mig.Name, "vmi", mig.Namespace+"/"+mig.Spec.VMIName, "reason", why)
	return nil
}

// mirror writes st as the VMI's status.migrationState and, with moveTo
// set, binds the VMI to that node (status.nodeName, then the
// kubevirt.io/nodeName label the nodes' informers select on).
func (c *Controller) mirror(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, st *kubevirtv1.VirtualMachineInstanceMigrationState, moveTo string) error {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := c.cfg.Virt.VMIs.Get(ctx, vmi.Namespace, vmi.Name)
		if err != nil {
			return err
		}
		if cur.UID != vmi.UID {
			return nil
		}
		out := cur.DeepCopy()
		out.Status.MigrationState = st.DeepCopy()
		if moveTo != "" {
			out.Status.NodeName, out.Status.EvacuationNodeName = moveTo, ""
			setMigratedCondition(out)
			setEvictionRequested(out)
		}
		if _, err := c.cfg.Virt.VMIs.UpdateStatus(ctx, out); err != nil {
			return err
		}
		if moveTo == "" {
			return nil
		}
		cur, err = c.cfg.Virt.VMIs.Get(ctx, vmi.Namespace, vmi.Name)
		if err != nil {
			return err
		}
		if cur.Labels[kubevirtv1.NodeNameLabel] == moveTo {
			return nil
		}
		out = cur.DeepCopy()
		if out.Labels == nil {
			out.Labels = map[string]string{}
		}
		out.Labels[kubevirtv1.NodeNameLabel] = moveTo
		_, err = c.cfg.Virt.VMIs.Update(ctx, out)
		return err
	})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vmi %s/%s migration state: %w", vmi.Namespace, vmi.Name, err)
	}
	return nil
}

// setMigratedCondition drops the conditions the source node wrote about
// its domain; the target node writes its own.
func setMigratedCondition(vmi *kubevirtv1.VirtualMachineInstance) {
	vmi.Status.Conditions = slices.DeleteFunc(vmi.Status.Conditions, func(c kubevirtv1.VirtualMachineInstanceCondition) bool {
		return c.Type == kubevirtv1.VirtualMachineInstanceAgentConnected
	})
}

func addPhase(m *kubevirtv1.VirtualMachineInstanceMigration, p kubevirtv1.VirtualMachineInstanceMigrationPhase, at metav1.Time) {
	if m.Status.Phase == p {
		return
	}
	m.Status.Phase = p
	m.Status.PhaseTransitionTimestamps = append(m.Status.PhaseTransitionTimestamps,
		kubevirtv1.VirtualMachineInstanceMigrationPhaseTransitionTimestamp{Phase: p, PhaseTransitionTimestamp: at})
}

// since is how long ago the migration entered phase p (0 if it did not).
func since(m *kubevirtv1.VirtualMachineInstanceMigration, p kubevirtv1.VirtualMachineInstanceMigrationPhase) time.Duration {
	for _, t := range m.Status.PhaseTransitionTimestamps {
		if t.Phase == p {
			return time.Since(t.PhaseTransitionTimestamp.Time)
		}
	}
	return 0
}

// Refusal says why KubeVirt would refuse to migrate vmi (nil when it does
// not exist), "" when it would not.
func Refusal(vmi *kubevirtv1.VirtualMachineInstance, name string) string {
	switch {
	case vmi == nil:
		return fmt.Sprintf("the VMI %q does not exist", name)
	case vmi.Status.Phase != kubevirtv1.Running:
		return fmt.Sprintf("cannot migrate VMI %q: it is %s, not Running", name, phaseOf(vmi))
	case vmi.DeletionTimestamp != nil:
		return fmt.Sprintf("cannot migrate VMI %q: it is being deleted", name)
	}
	for _, cond := range vmi.Status.Conditions {
		if cond.Type == kubevirtv1.VirtualMachineInstanceIsMigratable && cond.Status == corev1.ConditionFalse {
			return fmt.Sprintf("Cannot migrate VMI, Reason: %s, Message: %s", cond.Reason, cond.Message)
		}
	}
	return ""
}

// Migratable reports whether vmi can be migrated (running, and not
// LiveMigratable=False); when not, it returns KubeVirt's refusal.
func Migratable(vmi *kubevirtv1.VirtualMachineInstance) (bool, string) {
	why := Refusal(vmi, vmi.Name)
	return why == "", why
}

func phaseOf(vmi *kubevirtv1.VirtualMachineInstance) kubevirtv1.VirtualMachineInstancePhase {
	if vmi.Status.Phase == "" {
		return kubevirtv1.Pending
	}
	return vmi.Status.Phase
}
