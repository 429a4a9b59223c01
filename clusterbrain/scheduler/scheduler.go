// Package scheduler is the brain's placement role: it puts every pending
// VirtualMachineInstance on a registered node that satisfies it (resources,
// node selection, VMI (anti-)affinity, taints, bridge resources of its
// networks, volume locality, KVM, the KubeVirt CR's workloads placement)
// and binds it by writing status.nodeName, which the node's agent watches.
// Decisions are taken one at a time against an assume cache, so bursts
// never double-book a node; bindings run in parallel.
package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// Config configures the scheduler.
type Config struct {
	Kube kubernetes.Interface
	Virt *client.Set
	// RestConfig, when set, replaces Kube and Virt with clients of the
	// scheduler's own, so bindings do not share the brain's client-side
	// rate limit (500 QPS, burst 1000).
	RestConfig *rest.Config
	Log        *slog.Logger
	// Binders is how many bindings run at once (default 128: a binding is
	// two writes in a row, mostly waiting for the API server).
	Binders int
	// VMIInformer, when set, is an informer of all VMIs shared with other
	// roles: the caller runs it (after New), the scheduler waits for its
	// sync. Nil: the scheduler makes and runs its own.
	VMIInformer cache.SharedIndexInformer
	// NodeInformer, when set, is an informer of all Nodes shared with
	// other roles, run by the caller as VMIInformer is. Nil: the
	// scheduler makes and runs its own.
	NodeInformer cache.SharedIndexInformer
	// Retry is how often an unschedulable VMI is tried again without any
	// change in the cluster (default 15s).
	Retry time.Duration
	// Snapshots locates the VolumeSnapshots unbound claims restore from,
	// whose node the VMI must land on. Nil: made from RestConfig when set,
	// else such claims are placed like any other.
	Snapshots SnapshotLocator
}

// SnapshotLocator finds the node keeping a VolumeSnapshot: an API read,
// which the scheduler makes before it takes its decision lock, never
// under it.
type SnapshotLocator interface {
	Locate(ctx context.Context, ns, name string) (snapshotv1.Location, error)
}

var _ SnapshotLocator = (*snapshotv1.Client)(nil)

// Scheduler places VMIs.
type Scheduler struct {
	cfg      Config
	factory  informers.SharedInformerFactory
	nodes    cache.SharedIndexInformer
	pods     cache.SharedIndexInformer // bound, not ended, stripped (pods.go)
	vmis     cache.SharedIndexInformer
	nads     cache.SharedIndexInformer
	kvs      cache.SharedIndexInformer
	vmims    cache.SharedIndexInformer // migrations, whose targets hold their VMIs' requests (migrations.go)
	pvcs     corelisters.PersistentVolumeClaimLister
	pvs      corelisters.PersistentVolumeLister
	scs      storagelisters.StorageClassLister
	queue    *controller.Queue
	recorder *controller.Recorder
	sem      chan struct{}
	binds    sync.WaitGroup // bindings in flight
	ownVMIs  bool           // the scheduler runs the VMI informer

	memoMu sync.Mutex
	memo   map[types.UID]placedMemo // bound VMIs' placements by UID

	// decideMu makes decisions one at a time: each sees every earlier
	// one in the assume cache (the scheduler's loop and Reserve).
	decideMu sync.Mutex
	ready    atomic.Bool // the caches decisions read have synced
	now      func() time.Time

	mu       sync.Mutex
	assumed  map[types.UID]assumption
	reserved map[string]reservation    // namespace/name → node held before creation
	holds    map[types.UID]reservation // VMI → migration target chosen, not recorded yet
	waiting  map[string]bool           // unschedulable VMIs, retried on cluster changes
}

type assumption struct {
	node string
	p    placed
}

const nodeIndex = "node"

// New builds the scheduler.
func New(cfg Config) (*Scheduler, error) {
	if cfg.RestConfig != nil {
		rc := rest.CopyConfig(cfg.RestConfig)
		rc.QPS, rc.Burst = 500, 1000
		var err error
		if cfg.Kube, err = kubernetes.NewForConfig(rc); err != nil {
			return nil, err
		}
		if cfg.Virt, err = client.NewSet(rc); err != nil {
			return nil, err
		}
		if cfg.Snapshots == nil {
			dyn, err := dynamic.NewForConfig(rc)
			if err != nil {
				return nil, err
			}
			cfg.Snapshots = snapshotv1.NewClient(dyn)
		}
	}
	if cfg.Kube == nil || cfg.Virt == nil {
		return nil, errors.New("scheduler: clients are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Binders == 0 {
		cfg.Binders = 128
	}
	if cfg.Retry == 0 {
		cfg.Retry = 15 * time.Second
	}
	f := informers.NewSharedInformerFactory(cfg.Kube, 0)
	s := &Scheduler{
		cfg: cfg, factory: f,
		nodes:    cfg.NodeInformer,
		pods:     podInformer(f),
		vmis:     cfg.VMIInformer,
		nads:     cfg.Virt.NADs.Informer("", 0, nil),
		kvs:      cfg.Virt.KubeVirts.Informer("", 0, nil),
		vmims:    cfg.Virt.Migrations.Informer("", 0, nil),
		pvcs:     f.Core().V1().PersistentVolumeClaims().Lister(),
		pvs:      f.Core().V1().PersistentVolumes().Lister(),
		scs:      f.Storage().V1().StorageClasses().Lister(),
		recorder: controller.NewRecorder(client.NewScheme(), "nodevirt-scheduler"),
		sem:      make(chan struct{}, cfg.Binders),
		assumed:  map[types.UID]assumption{},
		reserved: map[string]reservation{},
		holds:    map[types.UID]reservation{},
		memo:     map[types.UID]placedMemo{},
		waiting:  map[string]bool{},
		now:      time.Now,
	}
	if s.vmis == nil {
		s.vmis = cfg.Virt.VMIs.Informer("", 0, nil)
		s.ownVMIs = true
	}
	if s.nodes == nil {
		s.nodes = f.Core().V1().Nodes().Informer() // run with the factory
	}
	// Register the listers' informers with the factory.
	f.Core().V1().PersistentVolumeClaims().Informer()
	f.Core().V1().PersistentVolumes().Informer()
	f.Storage().V1().StorageClasses().Informer()

	var err error
	s.queue, err = controller.New(controller.Config{Name: "scheduler", Sync: controller.NoRequeue(s.Sync),
		Backoff: controller.BackoffPlacement, Log: cfg.Log, KeyAttr: "vmi",
		Observe: func(err error) { metrics.Reconciled("scheduler", err) }})
	if err != nil {
		return nil, err
	}

	if err := s.vmis.AddIndexers(cache.Indexers{nodeIndex: func(obj any) ([]string, error) {
		vmi := obj.(*kubevirtv1.VirtualMachineInstance)
		if vmi.Status.NodeName == "" || vmi.IsFinal() {
			return nil, nil
		}
		return []string{vmi.Status.NodeName}, nil
	}}); err != nil {
		return nil, err
	}
	_, _ = s.vmis.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { s.vmiChanged(nil, obj.(*kubevirtv1.VirtualMachineInstance)) },
		UpdateFunc: func(o, n any) {
			s.vmiChanged(o.(*kubevirtv1.VirtualMachineInstance), n.(*kubevirtv1.VirtualMachineInstance))
		},
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance); ok {
				s.mu.Lock()
				delete(s.assumed, vmi.UID)
				s.mu.Unlock()
				s.memoMu.Lock()
				delete(s.memo, vmi.UID)
				s.memoMu.Unlock()
				s.retryWaiting()
			}
		},
	})
	retry := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.retryWaiting() },
		UpdateFunc: func(any, any) { s.retryWaiting() },
	}
	_, _ = s.nodes.AddEventHandler(retry)
	s.watchKubeVirt()
	// A pod that ends or goes frees its node's capacity.
	_, _ = s.pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(any, any) { s.retryWaiting() },
		DeleteFunc: func(any) { s.retryWaiting() },
	})
	_, _ = s.nads.AddEventHandler(cache.ResourceEventHandlerFuncs{
		// A NAD's resource name is part of the memoised demands.
		AddFunc:    func(any) { s.forgetPlacements(); s.retryWaiting() },
		UpdateFunc: func(any, any) { s.forgetPlacements(); s.retryWaiting() },
	})
	_, _ = f.Core().V1().PersistentVolumeClaims().Informer().AddEventHandler(retry)
	_, _ = f.Core().V1().PersistentVolumes().Informer().AddEventHandler(retry)
	if err := s.watchMigrations(); err != nil {
		return nil, err
	}
	return s, nil
}

// pending reports whether vmi waits for a node.
func pending(vmi *kubevirtv1.VirtualMachineInstance) bool {
	return vmi.Status.NodeName == "" && vmi.DeletionTimestamp == nil &&
		(vmi.Status.Phase == "" || vmi.Status.Phase == kubevirtv1.Pending)
}

func (s *Scheduler) vmiChanged(old, vmi *kubevirtv1.VirtualMachineInstance) {
	if vmi.Status.NodeName != "" {
		s.mu.Lock()
		delete(s.assumed, vmi.UID)
		s.mu.Unlock()
	}
	if old != nil && !old.IsFinal() && vmi.IsFinal() {
		s.retryWaiting()
	}
	if pending(vmi) {
		key, _ := cache.MetaNamespaceKeyFunc(vmi)
		s.queue.Add(key)
	}
}

func (s *Scheduler) retryWaiting() {
	s.mu.Lock()
	keys := make([]string, 0, len(s.waiting))
	for k := range s.waiting {
		keys = append(keys, k)
	}
	s.mu.Unlock()
	for _, k := range keys {
		s.queue.Add(k)
	}
}

// Name implements the brain's Role.
func (s *Scheduler) Name() string { return "scheduler" }

// Run schedules until ctx ends.
func (s *Scheduler) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer s.queue.ShutDown()
	defer s.recorder.Start(s.cfg.Kube)()
	if !s.startInformers(ctx) {
		return ctx.Err()
	}
	s.ready.Store(true)
	defer s.ready.Store(false)
	s.cfg.Log.Info("scheduler started")
	defer s.binds.Wait()
	return s.queue.Run(ctx)
}

// startInformers fills the caches decisions read; it reports false when
// ctx ended first.
func (s *Scheduler) startInformers(ctx context.Context) bool {
	s.factory.Start(ctx.Done())
	if s.ownVMIs {
		go s.vmis.RunWithContext(ctx)
	}
	go s.nads.RunWithContext(ctx)
	go s.kvs.RunWithContext(ctx)
	go s.vmims.RunWithContext(ctx)
	for _, ok := range s.factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return false
		}
	}
	return cache.WaitForCacheSync(ctx.Done(), s.nodes.HasSynced, s.vmis.HasSynced, s.nads.HasSynced, s.kvs.HasSynced, s.vmims.HasSynced)
}

// Sync takes the placement decision for the VMI named key and starts its
// binding (tracked by s.binds).
func (s *Scheduler) Sync(ctx context.Context, key string) error {
	obj, ok, err := s.vmis.GetStore().GetByKey(key)
	if err != nil {
		return err
	}
	s.mu.Lock()
	if !ok {
		delete(s.waiting, key)
	}
	s.mu.Unlock()
	if !ok {
		return nil
	}
	vmi := obj.(*kubevirtv1.VirtualMachineInstance)
	if !pending(vmi) {
		s.mu.Lock()
		delete(s.waiting, key)
		s.mu.Unlock()
		return nil
	}
	s.mu.Lock()
	_, binding := s.assumed[vmi.UID]
	s.mu.Unlock()
	if binding {
		return nil
	}
	snaps := s.locateSnapshots(ctx, vmi) // API reads: before the lock
	s.decideMu.Lock()
	var wffc []*corev1.PersistentVolumeClaim
	node := s.claimReservation(key, vmi) // decided before creation
	if node == "" {
		var p placed
		var err error
		node, wffc, p, err = s.decide(vmi, snaps)
		var fe *FitError
		if errors.As(err, &fe) {
			s.decideMu.Unlock()
			s.mu.Lock()
			s.waiting[key] = true
			s.mu.Unlock()
			s.queue.AddAfter(key, s.cfg.Retry)
			return s.markUnschedulable(ctx, vmi, fe.Error())
		}
		if err != nil {
			s.decideMu.Unlock()
			return err
		}
		s.mu.Lock()
		delete(s.waiting, key)
		s.assumed[vmi.UID] = assumption{node: node, p: p}
		s.mu.Unlock()
	}
	s.decideMu.Unlock()
	s.sem <- struct{}{}
	s.binds.Add(1)
	go func() {
		defer s.binds.Done()
		defer func() { <-s.sem }()
		if err := s.bind(ctx, vmi, node, wffc); err != nil {
			s.mu.Lock()
			delete(s.assumed, vmi.UID)
			s.mu.Unlock()
			s.cfg.Log.Warn("bind", "namespace", vmi.Namespace, "name", vmi.Name, "node", node, "err", err)
			s.queue.Retry(key)
		}
	}()
	return nil
}

// FitError says why no node can take a VMI.
type FitError struct{ msg string }

func (e *FitError) Error() string { return e.msg }

// Decide returns the node vmi should go to, or a *FitError.
func (s *Scheduler) Decide(vmi *kubevirtv1.VirtualMachineInstance) (string, error) {
	node, _, _, err := s.decide(vmi, s.locateSnapshots(context.Background(), vmi))
	return node, err
}

// decide places vmi from the informers' caches and snaps (where the
// snapshots its claims restore from are kept, looked up beforehand); it
// makes no API call, so it may run under decideMu.
func (s *Scheduler) decide(vmi *kubevirtv1.VirtualMachineInstance, snaps snapshotNodes) (string, []*corev1.PersistentVolumeClaim, placed, error) {
	states := s.snapshot()
	fail := func(prefix string, reasons map[string]int) (string, []*corev1.PersistentVolumeClaim, placed, error) {
		return "", nil, placed{}, &FitError{msg: nodeplacement.FitMessage(len(states), reasons, prefix)}
	}
	if why := unpermittedDevices(&vmi.Spec, s.permittedHostDevices()); why != "" {
		return fail("failed to render launch manifest: "+why, nil)
	}
	d, err := demandOf(vmi, s.memoryOvercommit(), s.nadResource)
	if err != nil {
		return fail(err.Error(), nil)
	}
	req := &request{vmi: vmi, demand: d, allowEmul: s.allowEmulation(), workloads: s.workloadPlacement()}
	for _, st := range states {
		if st.anti > 0 {
			req.placedAnti = true
			break
		}
	}
	wffc, err := s.volumeConstraints(vmi, req, snaps)
	if err != nil {
		return fail(err.Error(), nil)
	}
	reasons := map[string]int{}
	best := pick(states, func(st *nodeState) (float64, bool) {
		if why := filter(req, st, states); len(why) > 0 {
			for _, w := range why {
				reasons[w]++
			}
			return 0, false
		}
		return score(req, st, states), true
	})
	if best < 0 {
		return fail("", reasons)
	}
	p := placed{uid: vmi.UID, ns: vmi.Namespace, labels: labels.Set(vmi.Labels), demand: d}
	if a := vmi.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		p.anti = a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution
	}
	return states[best].node.Name, wffc, p, nil
}

// snapshot is every node with the VMIs bound to it, those assumed or
// reserved, and those migrating to it.
func (s *Scheduler) snapshot() []*nodeState {
	s.mu.Lock()
	assumed := make(map[types.UID]assumption, len(s.assumed))
	for k, v := range s.assumed {
		assumed[k] = v
	}
	reserved := s.liveReservations()
	s.mu.Unlock()
	nodes := s.nodes.GetStore().List()
	states := make([]*nodeState, 0, len(nodes))
	byName := map[string]*nodeState{}
	s.memoMu.Lock()
	for _, obj := range nodes {
		st := newNodeState(obj.(*corev1.Node))
		states = append(states, st)
		byName[st.node.Name] = st
		objs, _ := s.vmis.GetIndexer().ByIndex(nodeIndex, st.node.Name)
		st.placed = make([]placed, 0, len(objs)+4)
		for _, o := range objs {
			vmi := o.(*kubevirtv1.VirtualMachineInstance)
			if _, ok := assumed[vmi.UID]; ok {
				continue
			}
			st.add(s.placedOfLocked(vmi))
		}
		s.addPods(st)
	}
	s.addMigrating(byName)
	s.memoMu.Unlock()
	for _, a := range assumed {
		if st, ok := byName[a.node]; ok {
			st.add(a.p)
		}
	}
	for _, a := range reserved {
		if st, ok := byName[a.node]; ok {
			st.add(a.p)
		}
	}
	return states
}

// placedOfLocked is what a bound VMI occupies, computed once per version
// of it (a snapshot is taken for every decision). Callers hold memoMu.
func (s *Scheduler) placedOfLocked(vmi *kubevirtv1.VirtualMachineInstance) placed {
	m, ok := s.memo[vmi.UID]
	if ok && m.rv == vmi.ResourceVersion {
		return m.p
	}
	d, err := demandOf(vmi, s.memoryOvercommit(), s.nadResource)
	p := placed{uid: vmi.UID, ns: vmi.Namespace, labels: labels.Set(vmi.Labels), demand: d}
	if a := vmi.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		p.anti = a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution
	}
	if err == nil { // a missing NAD may appear: compute again then
		s.memo[vmi.UID] = placedMemo{rv: vmi.ResourceVersion, p: p}
	}
	return p
}

func (s *Scheduler) forgetPlacements() {
	s.memoMu.Lock()
	clear(s.memo)
	s.memoMu.Unlock()
}

type placedMemo struct {
	rv string
	p  placed
}

// nadResource returns the resourceName annotation of a NAD.
func (s *Scheduler) nadResource(ns, name string) (string, error) {
	obj, ok, err := s.nads.GetStore().GetByKey(ns + "/" + name)
	if err != nil {
		return "", err
	}
	if !ok {
		return "", fmt.Errorf("network-attachment-definition %s/%s not found", ns, name)
	}
	return obj.(*nadv1.NetworkAttachmentDefinition).Annotations[NADResourceName], nil
}

func podScheduled(status corev1.ConditionStatus, reason, msg string) kubevirtv1.VirtualMachineInstanceCondition {
	now := metav1.Now()
	return kubevirtv1.VirtualMachineInstanceCondition{Type: kubevirtv1.VirtualMachineInstanceConditionType(corev1.PodScheduled),
		Status: status, Reason: reason, Message: msg, LastTransitionTime: now, LastProbeTime: now}
}

func setCondition(vmi *kubevirtv1.VirtualMachineInstance, c kubevirtv1.VirtualMachineInstanceCondition) {
	for i := range vmi.Status.Conditions {
		if vmi.Status.Conditions[i].Type == c.Type {
			vmi.Status.Conditions[i] = c
			return
		}
	}
	vmi.Status.Conditions = append(vmi.Status.Conditions, c)
}

func (s *Scheduler) markUnschedulable(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, msg string) error {
	for _, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstanceConditionType(corev1.PodScheduled) && c.Reason == corev1.PodReasonUnschedulable && c.Message == msg {
			return nil
		}
	}
	upd := vmi.DeepCopy()
	if upd.Status.Phase == "" {
		upd.Status.Phase = kubevirtv1.Pending
	}
	setCondition(upd, podScheduled(corev1.ConditionFalse, corev1.PodReasonUnschedulable, msg))
	if _, err := s.cfg.Virt.VMIs.UpdateStatus(ctx, upd); err != nil {
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			return nil // a newer version is on its way through the informer
		}
		return fmt.Errorf("mark %s/%s unschedulable: %w", vmi.Namespace, vmi.Name, err)
	}
	s.recorder.Event(vmi, corev1.EventTypeWarning, "FailedScheduling", msg)
	s.cfg.Log.Info("unschedulable", "namespace", vmi.Namespace, "name", vmi.Name, "reason", msg)
	return nil
}

// bind writes the decision: selected-node on waiting claims, then
// status.nodeName and phase Scheduled, then the nodeName label unless the
// VMI was created with it.
func (s *Scheduler) bind(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, node string, wffc []*corev1.PersistentVolumeClaim) error {
	for _, pvc := range wffc {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{SelectedNodeAnno: node}}})
		if _, err := s.cfg.Kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return fmt.Errorf("select node for claim %s: %w", pvc.Name, err)
		}
	}
	upd := vmi.DeepCopy()
	for attempt := 0; ; attempt++ {
		upd.Status.NodeName = node
		upd.Status.Phase = kubevirtv1.Scheduled
		setCondition(upd, podScheduled(corev1.ConditionTrue, "", ""))
		_, err := s.cfg.Virt.VMIs.UpdateStatus(ctx, upd)
		if err == nil {
			break
		}
		if !apierrors.IsConflict(err) || attempt > 3 {
			return fmt.Errorf("bind: %w", err)
		}
		if upd, err = s.cfg.Virt.VMIs.Get(ctx, vmi.Namespace, vmi.Name); err != nil {
			return err
		}
		if upd.UID != vmi.UID || !pending(upd) {
			return nil
		}
	}
	if upd.Labels[kubevirtv1.NodeNameLabel] == node {
		s.cfg.Log.Debug("bound", "namespace", vmi.Namespace, "name", vmi.Name, "node", node)
		return nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{kubevirtv1.NodeNameLabel: node}}})
	if _, err := s.cfg.Virt.VMIs.Patch(ctx, vmi.Namespace, vmi.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
		s.cfg.Log.Warn("label vmi", "namespace", vmi.Namespace, "name", vmi.Name, "err", err)
	}
	s.cfg.Log.Debug("bound", "namespace", vmi.Namespace, "name", vmi.Name, "node", node)
	return nil
}
