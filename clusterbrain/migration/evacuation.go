package migration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
)

// Evacuation: a node tainted with the drain key (the KubeVirt CR's
// migrations.nodeDrainTaintKey, kubevirt.io/drain by default) is emptied
// by live migration. Each VMI bound to it gets KubeVirt's treatment by its
// evictionStrategy (the cluster's default from the KubeVirt CR when it has
// none), as KubeVirt's evacuation controller and eviction webhook give it:
//
//   - LiveMigrate and LiveMigrateIfPossible, when the VMI can migrate: it is
//     marked for eviction (status.evacuationNodeName, and the
//     EvictionRequested condition KubeVirt's VMI controller keeps on a
//     marked VMI) and gets a migration (annotated
//     kubevirt.io/evacuationMigration, driven like any other, within the
//     parallel limits). A failed one is tried again after evacuationRetry;
//     the move to the target clears the mark and the condition.
//   - External: marked only (its owner tears it down).
//   - LiveMigrate, when the VMI cannot migrate: it stays and is not marked
//     (KubeVirt's webhook refuses such an eviction). Its LiveMigratable
//     False condition says why, a FailedCreate event ("VirtualMachineInstance
//     is not migrateable", KubeVirt's evacuation controller's words) is
//     repeated every evacuationWarning while the node drains, and the
//     brain's kubevirt_vmi_non_evictable is 1 for it (NonEvictable; KubeVirt's
//     VMCannotBeEvicted alert fires on it).
//   - LiveMigrateIfPossible, when the VMI cannot migrate, and None: it
//     stays, as asked.

// ReasonFailedEvacuation is the event of a VMI that cannot leave a
// draining node (KubeVirt's evacuation controller's reason).
const ReasonFailedEvacuation = "FailedCreate"

// evacuationWarning is how often the event of a VMI that cannot leave a
// draining node is repeated (KubeVirt re-queues such a node every minute
// so that its warnings stay in the event log).
const evacuationWarning = time.Minute

const evacuationRetry = 30 * time.Second

// evacuate runs an evacuation pass every interval until ctx ends.
func (c *Controller) evacuate(ctx context.Context, interval time.Duration) {
	if !cache.WaitForCacheSync(ctx.Done(), c.informer.HasSynced, c.nodes.HasSynced) {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := c.evacuationPass(ctx); err != nil && ctx.Err() == nil {
			c.log.Warn("evacuation", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// evacuationPass starts what the draining nodes need.
func (c *Controller) evacuationPass(ctx context.Context) error {
	kvs, err := c.cfg.Virt.KubeVirts.List(ctx, metav1.NamespaceAll, metav1.ListOptions{})
	if err != nil {
		return err
	}
	key, clusterStrategy := DrainTaintKey(kvs), ClusterEvictionStrategy(kvs)
	for uid, at := range c.warned {
		if time.Since(at) >= evacuationWarning {
			delete(c.warned, uid)
		}
	}
	for _, n := range draining(c.nodes.GetStore(), key) {
		vmis, err := c.cfg.Virt.VMIs.List(ctx, metav1.NamespaceAll, metav1.ListOptions{LabelSelector: kubevirtv1.NodeNameLabel + "=" + n.Name})
		if err != nil {
			return err
		}
		for _, vmi := range vmis {
			if vmi.Status.NodeName != n.Name || vmi.IsFinal() || vmi.DeletionTimestamp != nil {
				continue
			}
			if err := c.evacuateVMI(ctx, vmi, n.Name, evictionStrategy(vmi, clusterStrategy)); err != nil {
				c.log.Warn("evacuation", "vmi", vmi.Namespace+"/"+vmi.Name, "node", n.Name, "err", err)
			}
		}
	}
	return nil
}

// DefaultDrainTaintKey is KubeVirt's nodeDrainTaintKey default.
const DefaultDrainTaintKey = "kubevirt.io/drain"

// DrainTaintKey is the taint (NoSchedule) that marks a node for
// evacuation: the KubeVirt CR's nodeDrainTaintKey, else KubeVirt's default.
func DrainTaintKey(kvs []*kubevirtv1.KubeVirt) string {
	key := DefaultDrainTaintKey
	for _, kv := range kvs {
		if mc := kv.Spec.Configuration.MigrationConfiguration; mc != nil && mc.NodeDrainTaintKey != nil {
			key = *mc.NodeDrainTaintKey
		}
	}
	return key
}

// draining are the Nodes of the cache tainted key, by name: the cache's
// own objects, read and never written.
func draining(nodes cache.Store, key string) []*corev1.Node {
	var out []*corev1.Node
	for _, o := range nodes.List() {
		if n, ok := o.(*corev1.Node); ok && hasTaint(n, key) {
			out = append(out, n)
		}
	}
	slices.SortFunc(out, func(a, b *corev1.Node) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func (c *Controller) evacuateVMI(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, node string, strategy kubevirtv1.EvictionStrategy) error {
	switch strategy {
	case kubevirtv1.EvictionStrategyNone:
		return nil
	case kubevirtv1.EvictionStrategyExternal:
		return c.markEvacuating(ctx, vmi, node)
	}
	if why := Refusal(vmi, vmi.Name); why != "" {
		if strategy == kubevirtv1.EvictionStrategyLiveMigrate && time.Since(c.warned[vmi.UID]) >= evacuationWarning {
			c.warned[vmi.UID] = time.Now()
			c.recorder.Eventf(vmi, corev1.EventTypeWarning, ReasonFailedEvacuation,
				"VirtualMachineInstance is not migrateable: node %s is draining: %s", node, why)
		}
		return nil
	}
	for _, o := range c.informer.GetIndexer().List() {
		m := o.(*kubevirtv1.VirtualMachineInstanceMigration)
		if m.Namespace != vmi.Namespace || m.Spec.VMIName != vmi.Name {
			continue
		}
		if !migstate.Final(m) {
			return nil // one is under way
		}
		if m.Status.Phase == kubevirtv1.MigrationFailed && m.Annotations[kubevirtv1.EvacuationMigrationAnnotation] == node &&
			time.Since(m.CreationTimestamp.Time) < evacuationRetry {
			return nil
		}
	}
	if err := c.markEvacuating(ctx, vmi, node); err != nil {
		return err
	}
	mig, err := c.cfg.Virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "kubevirt-evacuation-", Namespace: vmi.Namespace,
			Annotations: map[string]string{kubevirtv1.EvacuationMigrationAnnotation: node}},
		Spec: kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: vmi.Name},
	})
	if err != nil {
		return fmt.Errorf("create evacuation migration: %w", err)
	}
	c.log.Info("evacuating", "vmi", vmi.Namespace+"/"+vmi.Name, "node", node, "migration", mig.Name)
	return nil
}

// markEvacuating marks the VMI for eviction from node:
// status.evacuationNodeName and the EvictionRequested condition.
func (c *Controller) markEvacuating(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, node string) error {
	if vmi.Status.EvacuationNodeName == node && evictionRequested(vmi) {
		return nil
	}
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := c.cfg.Virt.VMIs.Get(ctx, vmi.Namespace, vmi.Name)
		if err != nil {
			return err
		}
		cur.Status.EvacuationNodeName = node
		setEvictionRequested(cur)
		_, err = c.cfg.Virt.VMIs.UpdateStatus(ctx, cur)
		return err
	})
}

// evictionRequested reports whether the VMI has KubeVirt's
// EvictionRequested condition.
func evictionRequested(vmi *kubevirtv1.VirtualMachineInstance) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstanceEvictionRequested && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// setEvictionRequested keeps KubeVirt's EvictionRequested condition as its
// VMI controller does: True while status.evacuationNodeName is set, absent
// otherwise.
func setEvictionRequested(vmi *kubevirtv1.VirtualMachineInstance) {
	vmi.Status.Conditions = slices.DeleteFunc(vmi.Status.Conditions, func(c kubevirtv1.VirtualMachineInstanceCondition) bool {
		return c.Type == kubevirtv1.VirtualMachineInstanceEvictionRequested
	})
	if vmi.Status.EvacuationNodeName == "" {
		return
	}
	now := metav1.Now()
	vmi.Status.Conditions = append(vmi.Status.Conditions, kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstanceEvictionRequested, Status: corev1.ConditionTrue,
		Reason: kubevirtv1.VirtualMachineInstanceReasonEvictionRequested, Message: "VMI is marked for eviction",
		LastProbeTime: now, LastTransitionTime: now,
	})
}

// ClusterEvictionStrategy is the KubeVirt CR's evictionStrategy, the
// default of VMIs that set none (None when no CR sets one).
func ClusterEvictionStrategy(kvs []*kubevirtv1.KubeVirt) kubevirtv1.EvictionStrategy {
	for _, kv := range kvs {
		if s := kv.Spec.Configuration.EvictionStrategy; s != nil {
			return *s
		}
	}
	return kubevirtv1.EvictionStrategyNone
}

func evictionStrategy(vmi *kubevirtv1.VirtualMachineInstance, clusterDefault kubevirtv1.EvictionStrategy) kubevirtv1.EvictionStrategy {
	if vmi.Spec.EvictionStrategy != nil {
		return *vmi.Spec.EvictionStrategy
	}
	return clusterDefault
}

// NonEvictable is KubeVirt's kubevirt_vmi_non_evictable: the VMI's
// eviction strategy (clusterDefault when it sets none) is LiveMigrate but
// it is not LiveMigratable (a VMI whose condition is not there yet counts
// as not migratable, as upstream).
func NonEvictable(vmi *kubevirtv1.VirtualMachineInstance, clusterDefault kubevirtv1.EvictionStrategy) bool {
	if evictionStrategy(vmi, clusterDefault) != kubevirtv1.EvictionStrategyLiveMigrate {
		return false
	}
	for _, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstanceIsMigratable {
			return c.Status != corev1.ConditionTrue
		}
	}
	return true
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key && (t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute) {
			return true
		}
	}
	return false
}
