// Package nodefailure is the brain's side of package fencing: it keeps the
// Ready condition and the unreachable / not-ready taints of nodevirt's
// nodes from their Leases, and fails the VMIs of lost nodes over so their
// VMs' runStrategy can start them elsewhere.
package nodefailure

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	coordinationinformers "k8s.io/client-go/informers/coordination/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/fencing"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// LabelManagedBy marks the Nodes a node agent owns (no kubelet): those are
// the ones whose condition and taints this controller keeps.
const LabelManagedBy = "nodevirt.io/nodeagent"

// Config configures the controller.
type Config struct {
	Kube kubernetes.Interface
	Virt *client.Set
	// Grace, Window and Margin are the timeline of package fencing
	// (its defaults when zero).
	Grace, Window, Margin time.Duration
	// Interval is how often nodes are checked at least (2 s when zero);
	// Run also checks as soon as a node's next deadline (grace, window +
	// margin) passes.
	Interval time.Duration
	// Nodes is the brain's shared informer of every Node; nil: the
	// controller runs one of its own.
	Nodes cache.SharedIndexInformer
	// Leases is the brain's shared informer of the node Leases (namespace
	// kube-node-lease); nil: the controller runs one of its own.
	Leases cache.SharedIndexInformer
	Log    *slog.Logger
	// Now is the clock (time.Now when nil).
	Now func() time.Time
}

// Controller is the node-failure role.
//
// It times each node from when it last saw the node's Lease renewed (its
// own clock), not from the renewal time written in the Lease: a brain that
// just took over, or that could not read the API for a while (an API
// server outage), gives every node a full window again instead of failing
// everything over at once; and a node's clock never shortens its window.
// When every node would be lost at once, the trouble is on the brain's
// side: nothing is failed over.
//
// Nodes and Leases come from informers' caches, so a check reads nothing
// from the API server while every node renews. A cache can lag the API
// (a watch that broke and waits to be opened again): before a node is
// judged on a renewal older than the grace, its Lease is read again from
// the API server, and the brain that cannot read it decides nothing.
type Controller struct {
	cfg Config
	// mu guards seen, written by Sync and by the Lease watch.
	mu sync.Mutex
	// seen is, per node, the last renewal time read from its Lease and
	// when this brain first read it.
	seen map[string]observation
	// blind is set when the last check could not read the API.
	blind bool
	// nodes and leases are cfg.Nodes and cfg.Leases, else the
	// controller's own.
	nodes, leases controller.Shared
}

type observation struct {
	renewal time.Time
	at      time.Time
}

// New returns the controller.
func New(cfg Config) (*Controller, error) {
	if cfg.Kube == nil || cfg.Virt == nil {
		return nil, errors.New("nodefailure: kube and virt clients are required")
	}
	if cfg.Grace == 0 {
		cfg.Grace = fencing.DefaultGrace
	}
	if cfg.Window == 0 {
		cfg.Window = fencing.DefaultWindow
	}
	if cfg.Margin == 0 {
		cfg.Margin = fencing.DefaultMargin
	}
	// A node is unreachable no later than it is lost.
	cfg.Grace = min(cfg.Grace, cfg.Window)
	if cfg.Interval == 0 {
		cfg.Interval = 2 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	c := &Controller{cfg: cfg, seen: map[string]observation{}}
	c.nodes = controller.SharedNodes(cfg.Kube, cfg.Nodes)
	c.leases = controller.Share(cfg.Leases, func() cache.SharedIndexInformer { return NewLeaseInformer(cfg.Kube) })
	return c, nil
}

// Name implements daemon.Role.
func (c *Controller) Name() string { return "node-failure" }

// Run checks every node each interval, and when a node's next deadline
// passes, until ctx ends. A watch on the Leases times each renewal when it
// happens rather than at the next check: polled alone, a renewal was seen
// up to an interval late, and a lost node failed over up to an interval
// after its deadline, two intervals in all.
func (c *Controller) Run(ctx context.Context) error {
	c.nodes.RunOwn(ctx)
	c.leases.RunOwn(ctx)
	if err := c.watchLeases(); err != nil {
		return err
	}
	if !cache.WaitForCacheSync(ctx.Done(), c.nodes.HasSynced, c.leases.HasSynced) {
		return nil
	}
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if err := c.Sync(ctx); err != nil && ctx.Err() == nil {
			c.cfg.Log.Warn("node failure check", "err", err)
		}
		t.Reset(c.nextCheck(c.cfg.Now()))
	}
}

// NewLeaseInformer is an informer of the node Leases, the one Config.Leases
// takes.
func NewLeaseInformer(kube kubernetes.Interface) cache.SharedIndexInformer {
	return coordinationinformers.NewLeaseInformer(kube, corev1.NamespaceNodeLease, 0, cache.Indexers{})
}

// watchLeases records each node Lease's renewals as the API server sends
// them.
func (c *Controller) watchLeases() error {
	observe := func(obj any) {
		if l, ok := obj.(*coordinationv1.Lease); ok {
			c.observe(l.Name, leaseRenewed(l), c.cfg.Now())
		}
	}
	if _, err := c.leases.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: observe, UpdateFunc: func(_, obj any) { observe(obj) }}); err != nil {
		return fmt.Errorf("lease watch: %w", err)
	}
	return nil
}

// observe records that node's Lease reads renewal at now, keeping the
// earlier sighting of the same renewal.
func (c *Controller) observe(node string, renewal, now time.Time) observation {
	c.mu.Lock()
	defer c.mu.Unlock()
	o, known := c.seen[node]
	if !known || !o.renewal.Equal(renewal) {
		o = observation{renewal: renewal, at: now}
		c.seen[node] = o
	}
	return o
}

// nextCheck is how long until the next check: the interval, or less when
// a node's grace or window + margin ends sooner.
func (c *Controller) nextCheck(now time.Time) time.Duration {
	const past = 10 * time.Millisecond // checked just after, not at, the deadline
	next := c.cfg.Interval
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, o := range c.seen {
		for _, d := range []time.Duration{c.cfg.Grace, c.cfg.Window + c.cfg.Margin} {
			if left := o.at.Add(d).Sub(now) + past; left > 0 && left < next {
				next = left
			}
		}
	}
	return next
}

// Sync checks every node agent's Node once. Nodes and Leases come from
// the informers' caches (Run waits until they are filled); a node whose
// cached renewal is older than the grace has its Lease read again from
// the API server (one by one for up to lateReads nodes, else one List of
// them all), and a brain that cannot read it (or, back from that, its
// first read of the Leases) stops the check: nothing is decided without
// the API.
func (c *Controller) Sync(ctx context.Context) error {
	leases := c.cfg.Kube.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	if c.blind {
		if _, err := leases.List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
			return fmt.Errorf("read node leases: %w", err)
		}
		// Back from not seeing the API: what happened meanwhile is unknown,
		// every node gets a full window from now.
		c.mu.Lock()
		c.seen = map[string]observation{}
		c.mu.Unlock()
		c.blind = false
	}
	now := c.cfg.Now()
	var nodes []*corev1.Node
	late := map[string]bool{}
	for _, n := range c.agentNodes() {
		l := c.cachedLease(n.Name)
		if l == nil {
			continue // registering
		}
		nodes = append(nodes, n)
		if o := c.observe(n.Name, leaseRenewed(l), now); now.Sub(o.at) > c.cfg.Grace {
			late[n.Name] = true
		}
	}
	// The cache may lag: on the late nodes the API server has the last
	// word.
	fresh, err := c.readLeases(ctx, late)
	if err != nil {
		c.blind = true
		return err
	}
	var states []nodeCheck
	for _, n := range nodes {
		if late[n.Name] {
			l, ok := fresh[n.Name]
			if !ok {
				continue // the node is going
			}
			c.observe(n.Name, leaseRenewed(l), now)
		}
		c.mu.Lock()
		o := c.seen[n.Name]
		c.mu.Unlock()
		states = append(states, c.check(n, o.at, now))
	}
	lost := 0
	for _, st := range states {
		if st.Lost {
			lost++
		}
	}
	holdBack := lost > 1 && lost == len(states)
	if holdBack {
		c.cfg.Log.Warn("every node looks lost: not failing over (the trouble is likely on the brain's side)", "nodes", lost)
	}
	var errs []error
	for _, st := range states {
		if err := c.apply(ctx, st, holdBack); err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", st.node.Name, err))
		}
	}
	return errors.Join(errs...)
}

// lateReads is how many late nodes' Leases a check reads one by one;
// for more, it lists them all once.
const lateReads = 8

// readLeases reads the named nodes' Leases from the API server (a node
// with none is left out).
func (c *Controller) readLeases(ctx context.Context, names map[string]bool) (map[string]*coordinationv1.Lease, error) {
	leases := c.cfg.Kube.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	out := map[string]*coordinationv1.Lease{}
	if len(names) > lateReads {
		list, err := leases.List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, fmt.Errorf("list node leases: %w", err)
		}
		for i := range list.Items {
			if names[list.Items[i].Name] {
				out[list.Items[i].Name] = &list.Items[i]
			}
		}
		return out, nil
	}
	for name := range names {
		l, err := leases.Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return nil, fmt.Errorf("read lease %s: %w", name, err)
		default:
			out[name] = l
		}
	}
	return out, nil
}

// cachedLease is node's Lease in the informer's cache (nil when there is
// none): the cache's own object, read and never written.
func (c *Controller) cachedLease(node string) *coordinationv1.Lease {
	o, ok, err := c.leases.GetStore().GetByKey(corev1.NamespaceNodeLease + "/" + node)
	if err != nil || !ok {
		return nil
	}
	l, _ := o.(*coordinationv1.Lease)
	return l
}

// agentNodes are the node agents' Nodes in the informer's cache, by name:
// the cache's own objects, read and never written.
func (c *Controller) agentNodes() []*corev1.Node {
	var nodes []*corev1.Node
	for _, o := range c.nodes.GetStore().List() {
		if n, ok := o.(*corev1.Node); ok {
			if _, agent := n.Labels[LabelManagedBy]; agent {
				nodes = append(nodes, n)
			}
		}
	}
	slices.SortFunc(nodes, func(a, b *corev1.Node) int { return strings.Compare(a.Name, b.Name) })
	return nodes
}

// nodeCheck is one node's state and what it was decided from.
type nodeCheck struct {
	State
	node       *corev1.Node
	lastSeen   time.Time
	agentReady corev1.ConditionStatus
	oos        bool
}

// State is what the lease and the agent's own condition say of a node.
type State struct {
	// Ready is the Ready condition's status to keep.
	Ready corev1.ConditionStatus
	// Taints are the lifecycle taints the node must carry (others it must
	// not).
	Taints []corev1.Taint
	// Lost says its VMIs are to be failed over.
	Lost bool
}

// lifecycleTaints are the taints this controller owns.
var lifecycleTaints = []string{corev1.TaintNodeUnreachable, corev1.TaintNodeNotReady}

// Decide is the node's state at now, from its Lease's last renewal, its
// agent's Ready condition and whether it is out of service.
func Decide(now, renewed time.Time, agentReady corev1.ConditionStatus, outOfService bool, grace, window, margin time.Duration) State {
	taints := func(key string) []corev1.Taint {
		return []corev1.Taint{{Key: key, Effect: corev1.TaintEffectNoSchedule}, {Key: key, Effect: corev1.TaintEffectNoExecute}}
	}
	s := State{Ready: agentReady, Lost: fencing.Lost(now, renewed, window, margin, outOfService)}
	switch {
	case now.Sub(renewed) > grace:
		s.Ready, s.Taints = corev1.ConditionUnknown, taints(corev1.TaintNodeUnreachable)
	case agentReady != corev1.ConditionTrue:
		s.Taints = taints(corev1.TaintNodeNotReady)
	}
	return s
}

func (c *Controller) check(n *corev1.Node, lastSeen, now time.Time) nodeCheck {
	agentReady := corev1.ConditionUnknown
	for _, cond := range n.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			agentReady = cond.Status
		}
	}
	oos := slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == fencing.TaintOutOfService })
	return nodeCheck{State: Decide(now, lastSeen, agentReady, oos, c.cfg.Grace, c.cfg.Window, c.cfg.Margin),
		node: n, lastSeen: lastSeen, agentReady: agentReady, oos: oos}
}

func (c *Controller) apply(ctx context.Context, st nodeCheck, holdBack bool) error {
	var errs []error
	if st.Ready == corev1.ConditionUnknown && st.agentReady != corev1.ConditionUnknown {
		errs = append(errs, c.markUnknown(ctx, st.node.Name, st.lastSeen))
	}
	errs = append(errs, c.keepTaints(ctx, st.node, st.Taints))
	if st.Lost && (!holdBack || st.oos) {
		errs = append(errs, c.failOver(ctx, st.node.Name, st.oos))
	}
	return errors.Join(errs...)
}

func leaseRenewed(l *coordinationv1.Lease) time.Time {
	if l.Spec.RenewTime != nil {
		return l.Spec.RenewTime.Time
	}
	if l.Spec.AcquireTime != nil {
		return l.Spec.AcquireTime.Time
	}
	return l.CreationTimestamp.Time
}

func (c *Controller) markUnknown(ctx context.Context, node string, renewed time.Time) error {
	now := metav1.NewTime(c.cfg.Now())
	msg := fmt.Sprintf("nodevirt nodeagent stopped renewing its lease (last renewal seen %s)", renewed.UTC().Format(time.RFC3339))
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{{
		Type: corev1.NodeReady, Status: corev1.ConditionUnknown, Reason: "NodeStatusUnknown", Message: msg,
		LastHeartbeatTime: metav1.NewTime(renewed), LastTransitionTime: now,
	}}}})
	if _, err := c.cfg.Kube.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("mark ready unknown: %w", err)
	}
	c.cfg.Log.Warn("node unreachable", "node", node, "lastRenewal", renewed)
	return nil
}

// keepTaints makes the node's lifecycle taints want, leaving other taints.
func (c *Controller) keepTaints(ctx context.Context, n *corev1.Node, want []corev1.Taint) error {
	var kept []corev1.Taint
	for _, t := range n.Spec.Taints {
		if !slices.Contains(lifecycleTaints, t.Key) {
			kept = append(kept, t)
		}
	}
	now := metav1.NewTime(c.cfg.Now())
	for _, w := range want {
		i := slices.IndexFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == w.Key && t.Effect == w.Effect })
		if i >= 0 {
			kept = append(kept, n.Spec.Taints[i])
			continue
		}
		if w.Effect == corev1.TaintEffectNoExecute {
			w.TimeAdded = &now
		}
		kept = append(kept, w)
	}
	if sameTaints(kept, n.Spec.Taints) {
		return nil
	}
	upd := n.DeepCopy()
	upd.Spec.Taints = kept
	if _, err := c.cfg.Kube.CoreV1().Nodes().Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("taints: %w", err)
	}
	c.cfg.Log.Info("node taints", "node", n.Name, "taints", taintKeys(kept))
	return nil
}

func sameTaints(a, b []corev1.Taint) bool {
	if len(a) != len(b) {
		return false
	}
	for _, t := range a {
		if !slices.ContainsFunc(b, func(u corev1.Taint) bool { return u.Key == t.Key && u.Effect == t.Effect && u.Value == t.Value }) {
			return false
		}
	}
	return true
}

func taintKeys(ts []corev1.Taint) []string {
	var out []string
	for _, t := range ts {
		out = append(out, t.Key+":"+string(t.Effect))
	}
	return out
}

// failOver marks the lost node's VMIs Failed (NodeUnreachable) and drops
// the node agent's finalizer, so the VM controller replaces them.
func (c *Controller) failOver(ctx context.Context, node string, outOfService bool) error {
	vmis, err := c.cfg.Virt.VMIs.List(ctx, metav1.NamespaceAll, metav1.ListOptions{LabelSelector: kubevirtv1.NodeNameLabel + "=" + node})
	if err != nil {
		return fmt.Errorf("list vmis: %w", err)
	}
	why := fmt.Sprintf("node %s stopped renewing its lease for longer than the fencing window (%s) plus margin (%s)",
		node, c.cfg.Window, c.cfg.Margin)
	if outOfService {
		why = fmt.Sprintf("node %s is tainted %s", node, fencing.TaintOutOfService)
	}
	var errs []error
	for _, vmi := range vmis {
		if vmi.Status.NodeName != node {
			continue
		}
		if !vmi.IsFinal() {
			errs = append(errs, c.fail(ctx, vmi, why))
			continue
		}
		if slices.Contains(vmi.Finalizers, fencing.HandlerFinalizer) {
			errs = append(errs, c.release(ctx, vmi))
		}
	}
	return errors.Join(errs...)
}

func (c *Controller) fail(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, why string) error {
	upd := vmi.DeepCopy()
	upd.Status.Phase = kubevirtv1.Failed
	upd.Status.Reason = fencing.ReasonNodeUnreachable
	now := metav1.NewTime(c.cfg.Now())
	upd.Status.PhaseTransitionTimestamps = append(upd.Status.PhaseTransitionTimestamps,
		kubevirtv1.VirtualMachineInstancePhaseTransitionTimestamp{Phase: kubevirtv1.Failed, PhaseTransitionTimestamp: now})
	for i := range upd.Status.Conditions {
		if upd.Status.Conditions[i].Type == kubevirtv1.VirtualMachineInstanceReady {
			upd.Status.Conditions[i].Status = corev1.ConditionFalse
			upd.Status.Conditions[i].Reason = fencing.ReasonNodeUnreachable
			upd.Status.Conditions[i].Message = why
			upd.Status.Conditions[i].LastTransitionTime = now
		}
	}
	updated, err := c.cfg.Virt.VMIs.UpdateStatus(ctx, upd)
	if err != nil {
		return fmt.Errorf("fail vmi %s/%s: %w", vmi.Namespace, vmi.Name, err)
	}
	c.cfg.Log.Warn("vmi failed over: node lost", "vmi", vmi.Namespace+"/"+vmi.Name, "node", vmi.Status.NodeName)
	c.event(ctx, vmi, why)
	return c.release(ctx, updated)
}

// release drops the node agent's finalizer: the agent is fenced and will
// clean its domain when it comes back.
func (c *Controller) release(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	fins := slices.DeleteFunc(slices.Clone(vmi.Finalizers), func(f string) bool { return f == fencing.HandlerFinalizer })
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"finalizers": fins, "resourceVersion": vmi.ResourceVersion}})
	if _, err := c.cfg.Virt.VMIs.Patch(ctx, vmi.Namespace, vmi.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("release vmi %s/%s: %w", vmi.Namespace, vmi.Name, err)
	}
	return nil
}

// event records the failover on the VMI's VM (the VMI when it has none).
func (c *Controller) event(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, why string) {
	ref := corev1.ObjectReference{APIVersion: kubevirtv1.SchemeGroupVersion.String(), Kind: "VirtualMachineInstance",
		Namespace: vmi.Namespace, Name: vmi.Name, UID: vmi.UID}
	for _, o := range vmi.OwnerReferences {
		if o.Kind == "VirtualMachine" {
			ref = corev1.ObjectReference{APIVersion: o.APIVersion, Kind: o.Kind, Namespace: vmi.Namespace, Name: o.Name, UID: o.UID}
		}
	}
	now := metav1.NewTime(c.cfg.Now())
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: ref.Name + ".", Namespace: vmi.Namespace},
		InvolvedObject: ref, Reason: fencing.ReasonNodeUnreachable, Type: corev1.EventTypeWarning,
		Message: fmt.Sprintf("VMI %s failed: %s", vmi.Name, why), FirstTimestamp: now, LastTimestamp: now, Count: 1,
		Source: corev1.EventSource{Component: "nodevirt-node-failure"},
	}
	if _, err := c.cfg.Kube.CoreV1().Events(vmi.Namespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		c.cfg.Log.Warn("event", "vmi", vmi.Namespace+"/"+vmi.Name, "err", err)
	}
}
