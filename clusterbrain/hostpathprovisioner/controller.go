// Package hostpathprovisioner is the brain's half of the
// hostpath-provisioner-operator: for every HostPathProvisioner it keeps
// status.storagePoolStatuses (upstream's shape) and the
// Available/Progressing/Degraded conditions from what the node agents report
// on their Nodes (contract: clusterbrain/api/poolstate), and one StorageClass
// per pool for the hostpath CSI driver. The node agents open the pools
// themselves; the brain never touches a host.
package hostpathprovisioner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/poolstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// Names the StorageClasses carry.
const (
	// DriverName is the hostpath CSI driver the classes name.
	DriverName = "kubevirt.io.hostpath-provisioner"
	// ClassPrefix + pool name is a pool's StorageClass.
	ClassPrefix = "hostpath-csi-"
	// LabelOwner names the HostPathProvisioner a class belongs to.
	LabelOwner     = "hostpathprovisioner.kubevirt.io/owner"
	labelManagedBy = "app.kubernetes.io/managed-by"
	managedBy      = "nodevirt-clusterbrain"
	// schedulableLabel marks the Nodes of node agents.
	schedulableLabel = "kubevirt.io/schedulable"
	resync           = 30 * time.Second
)

// Condition types (openshift/custom-resource-status).
const (
	ConditionAvailable   = "Available"
	ConditionProgressing = "Progressing"
	ConditionDegraded    = "Degraded"
)

// Config configures the controller.
type Config struct {
	Kube kubernetes.Interface
	Virt *client.Set
	// Version goes into the status' operator versions.
	Version string
	// Nodes is the brain's shared informer of every Node, whose pool
	// reports the status is made of; nil: the controller runs one of its
	// own.
	Nodes cache.SharedIndexInformer
	Log   *slog.Logger
}

// Controller keeps HostPathProvisioners' status and StorageClasses.
type Controller struct {
	cfg   Config
	log   *slog.Logger
	queue *controller.Queue
	hpps  cache.SharedIndexInformer
	nodes controller.Shared
}

// New builds the controller.
func New(cfg Config) (*Controller, error) {
	if cfg.Kube == nil || cfg.Virt == nil {
		return nil, errors.New("hostpathprovisioner: kube and virt clients are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	c := &Controller{cfg: cfg, log: cfg.Log}
	q, err := controller.New(controller.Config{Name: "hostpathprovisioner", Sync: controller.NoRequeue(c.Sync),
		Backoff: controller.BackoffAPI, Log: cfg.Log, KeyAttr: "hostpathprovisioner"})
	if err != nil {
		return nil, err
	}
	c.queue = q
	c.hpps = cfg.Virt.HostPathProvisioners.Informer("", resync, nil)
	c.nodes = controller.SharedNodes(cfg.Kube, cfg.Nodes)
	return c, nil
}

// Name implements daemon.Role.
func (c *Controller) Name() string { return "hostpathprovisioner" }

// Run reconciles until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	all := func(any) {
		for _, key := range c.hpps.GetStore().ListKeys() {
			c.queue.Add(key)
		}
	}
	if _, err := c.hpps.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: c.queue.Enqueue,
		UpdateFunc: func(_, n any) { c.queue.Enqueue(n) }, DeleteFunc: c.queue.Enqueue}); err != nil {
		return err
	}
	if _, err := c.nodes.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: all,
		UpdateFunc: func(o, n any) {
			if nodeChanged(o.(*corev1.Node), n.(*corev1.Node)) {
				all(n)
			}
		}, DeleteFunc: all}); err != nil {
		return err
	}
	go c.hpps.RunWithContext(ctx)
	c.nodes.RunOwn(ctx)
	return c.queue.Run(ctx, c.hpps.HasSynced, c.nodes.HasSynced)
}

// Sync brings one HostPathProvisioner's status and StorageClasses in line.
func (c *Controller) Sync(ctx context.Context, name string) error {
	hpp, err := c.cfg.Virt.HostPathProvisioners.Get(ctx, "", name)
	if apierrors.IsNotFound(err) {
		return c.syncClasses(ctx, name, nil, nil)
	}
	if err != nil {
		return fmt.Errorf("get hostpathprovisioner %s: %w", name, err)
	}
	var nodes []*corev1.Node
	for _, o := range c.nodes.GetStore().List() {
		nodes = append(nodes, o.(*corev1.Node))
	}
	st := Status(hpp, nodes, c.cfg.Version, time.Now())
	var served []string
	for _, p := range poolstate.Pools(hpp) {
		if p.Refused == "" {
			served = append(served, p.Name)
		}
	}
	if err := c.syncClasses(ctx, name, hpp, served); err != nil {
		return err
	}
	if apiequality.Semantic.DeepEqual(withoutTimes(hpp.Status), withoutTimes(st)) {
		return nil
	}
	upd := hpp.DeepCopyObject().(*hppv1beta1.HostPathProvisioner)
	upd.Status = st
	if _, err := c.cfg.Virt.HostPathProvisioners.UpdateStatus(ctx, upd); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("update status of hostpathprovisioner %s: %w", name, err)
	}
	c.log.Info("hostpathprovisioner status", "hostpathprovisioner", name, "phase", st.Phase, "pools", len(st.StoragePoolStatuses))
	return nil
}

// withoutTimes drops the timestamps, so an unchanged status is not written.
func withoutTimes(st hppv1beta1.HostPathProvisionerStatus) hppv1beta1.HostPathProvisionerStatus {
	var out hppv1beta1.HostPathProvisionerStatus
	api.DeepCopyJSON(&st, &out)
	for i := range out.Conditions {
		out.Conditions[i].LastHeartbeatTime, out.Conditions[i].LastTransitionTime = metav1.Time{}, metav1.Time{}
	}
	return out
}

// Status computes hpp's status from the nodes: per pool, the ready node
// agents hpp's workload selects (DesiredReady) and those reporting the pool
// Ready (CurrentReady); refusals and failures make it Degraded, naming the
// pool (and node).
func Status(hpp *hppv1beta1.HostPathProvisioner, nodes []*corev1.Node, version string, now time.Time) hppv1beta1.HostPathProvisionerStatus {
	var placed []*corev1.Node
	var reports = map[string]poolstate.NodePools{}
	var degraded, progressing []string
	for _, n := range nodes {
		if _, ok := n.Labels[schedulableLabel]; !ok || !nodeReady(n) || poolstate.Select(hpp, n) != "" {
			continue
		}
		placed = append(placed, n)
		r, err := poolstate.Decode(n)
		if err != nil {
			degraded = append(degraded, err.Error())
		}
		reports[n.Name] = r
	}
	sort.Slice(placed, func(i, j int) bool { return placed[i].Name < placed[j].Name })
	st := hppv1beta1.HostPathProvisionerStatus{StoragePoolStatuses: []hppv1beta1.StoragePoolStatus{}}
	available := len(placed) > 0
	for _, w := range poolstate.Pools(hpp) {
		ps := hppv1beta1.StoragePoolStatus{Name: w.Name, DesiredReady: len(placed)}
		if w.Refused != "" {
			ps.Phase, ps.DesiredReady = hppv1beta1.StoragePoolRefused, 0
			degraded = append(degraded, fmt.Sprintf("storage pool %s refused: %s", w.Name, w.Refused))
			st.StoragePoolStatuses = append(st.StoragePoolStatuses, ps)
			continue
		}
		for _, n := range placed {
			s, ok := reports[n.Name].For(w.Name, hpp.Name)
			switch {
			case !ok:
				progressing = append(progressing, fmt.Sprintf("node %s has not reported storage pool %s yet", n.Name, w.Name))
			case s.Phase == poolstate.PhaseReady:
				ps.CurrentReady++
			default:
				degraded = append(degraded, fmt.Sprintf("node %s: storage pool %s %s: %s", n.Name, w.Name, strings.ToLower(string(s.Phase)), s.Message))
			}
		}
		ps.Phase = hppv1beta1.StoragePoolPreparing
		if ps.DesiredReady > 0 && ps.CurrentReady == ps.DesiredReady {
			ps.Phase = hppv1beta1.StoragePoolReady
		}
		if ps.CurrentReady == 0 {
			available = false
		}
		st.StoragePoolStatuses = append(st.StoragePoolStatuses, ps)
	}
	availMsg := "every storage pool is served by at least one node"
	if len(placed) == 0 {
		availMsg = "no ready node agent is selected by spec.workload"
		available = false
	} else if !available {
		availMsg = "a storage pool is served by no node"
		if len(degraded) > 0 {
			availMsg += ": " + strings.Join(degraded, "; ")
		}
	}
	conds := []api.Condition{
		cond(ConditionAvailable, available, "Available", "NotAvailable", availMsg),
		cond(ConditionProgressing, len(progressing) > 0, "Progressing", "Reconciled", strings.Join(progressing, "; ")),
		cond(ConditionDegraded, len(degraded) > 0, "Degraded", "AsExpected", strings.Join(degraded, "; ")),
	}
	for i := range conds {
		conds[i].LastHeartbeatTime = metav1.NewTime(now)
		conds[i].LastTransitionTime = metav1.NewTime(now)
		for _, old := range hpp.Status.Conditions {
			if old.Type == conds[i].Type && old.Status == conds[i].Status {
				conds[i].LastTransitionTime = old.LastTransitionTime
			}
		}
	}
	st.Conditions = conds
	st.Phase = "Deploying"
	if available {
		st.Phase = "Deployed"
	}
	st.OperatorVersion, st.TargetVersion, st.ObservedVersion = version, version, version
	st.ObservedGeneration = hpp.Generation
	return st
}

func cond(typ string, ok bool, yes, no, msg string) api.Condition {
	c := api.Condition{Type: typ, Status: "False", Reason: no, Message: msg}
	if ok {
		c.Status, c.Reason = "True", yes
	}
	return c
}

// nodeChanged reports a change that matters to a status: labels (the
// placement), the pool report, taints, readiness. Heartbeats alone do not.
func nodeChanged(o, n *corev1.Node) bool {
	return nodeReady(o) != nodeReady(n) || !apiequality.Semantic.DeepEqual(o.Labels, n.Labels) ||
		o.Annotations[poolstate.AnnotationNodePools] != n.Annotations[poolstate.AnnotationNodePools] ||
		!apiequality.Semantic.DeepEqual(o.Spec.Taints, n.Spec.Taints)
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// syncClasses keeps one StorageClass per served pool of hpp (none when
// hpp is nil: it is gone) and removes its classes of pools it no longer
// defines. A class of that name the brain did not make is left alone.
func (c *Controller) syncClasses(ctx context.Context, name string, hpp *hppv1beta1.HostPathProvisioner, pools []string) error {
	scs := c.cfg.Kube.StorageV1().StorageClasses()
	for _, pool := range pools {
		want := classFor(hpp, pool)
		got, err := scs.Get(ctx, want.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			if _, err := scs.Create(ctx, want, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create storageclass %s: %w", want.Name, err)
			}
			c.log.Info("created storageclass", "storageclass", want.Name, "hostpathprovisioner", name, "pool", pool)
		case err != nil:
			return fmt.Errorf("get storageclass %s: %w", want.Name, err)
		case got.Labels[LabelOwner] != name:
			if got.Provisioner != DriverName || got.Parameters["storagePool"] != pool {
				c.log.Warn("storageclass name taken", "storageclass", want.Name, "hostpathprovisioner", name, "pool", pool)
			}
		}
	}
	list, err := scs.List(ctx, metav1.ListOptions{LabelSelector: LabelOwner + "=" + name})
	if err != nil {
		return fmt.Errorf("list storageclasses of %s: %w", name, err)
	}
	for _, sc := range list.Items {
		if slices.Contains(pools, sc.Parameters["storagePool"]) && sc.Name == ClassPrefix+sc.Parameters["storagePool"] {
			continue
		}
		if err := scs.Delete(ctx, sc.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete storageclass %s: %w", sc.Name, err)
		}
		c.log.Info("deleted storageclass", "storageclass", sc.Name, "hostpathprovisioner", name)
	}
	return nil
}

// classFor is the StorageClass of one pool: WaitForFirstConsumer (a pool
// is node-local), expandable, owned by the HostPathProvisioner.
func classFor(hpp *hppv1beta1.HostPathProvisioner, pool string) *storagev1.StorageClass {
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	reclaim := corev1.PersistentVolumeReclaimDelete
	expand := true
	return &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: ClassPrefix + pool,
			Labels: map[string]string{LabelOwner: hpp.Name, labelManagedBy: managedBy},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: hppv1beta1.SchemeGroupVersion.String(), Kind: "HostPathProvisioner",
				Name: hpp.Name, UID: hpp.UID}}},
		Provisioner:          DriverName,
		ReclaimPolicy:        &reclaim,
		VolumeBindingMode:    &wffc,
		AllowVolumeExpansion: &expand,
		Parameters:           map[string]string{"storagePool": pool},
	}
}
