package migration

import (
	"context"
	"fmt"
	"k8s.io/client-go/tools/cache"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
)

// Evacuation: a node tainted with the drain key (the KubeVirt CR's
// migrations.nodeDrainTaintKey, kubevirt.io/drain by default) is emptied
// by live migration. Each VMI bound to it gets KubeVirt's treatment by its
// evictionStrategy (the cluster's default from the KubeVirt CR when it has
// none): LiveMigrate and LiveMigrateIfPossible get a migration (annotated
// kubevirt.io/evacuationMigration, driven like any other, within the
// parallel limits) and status.evacuationNodeName; External gets
// status.evacuationNodeName only (its owner tears it down); None, and a
// VMI that cannot migrate, stay, the latter with a FailedEvacuation event
// saying why. A failed evacuation is tried again after evacuationRetry.

// ReasonFailedEvacuation is the event of a VMI that cannot leave a
// draining node.
const ReasonFailedEvacuation = "FailedEvacuation"

const evacuationRetry = 30 * time.Second

// evacuate runs an evacuation pass every interval until ctx ends.
func (c *Controller) evacuate(ctx context.Context, interval time.Duration) {
	if !cache.WaitForCacheSync(ctx.Done(), c.informer.HasSynced) {
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
	key, clusterStrategy := "kubevirt.io/drain", kubevirtv1.EvictionStrategyNone
	for _, kv := range kvs {
		if mc := kv.Spec.Configuration.MigrationConfiguration; mc != nil && mc.NodeDrainTaintKey != nil {
			key = *mc.NodeDrainTaintKey
		}
		if s := kv.Spec.Configuration.EvictionStrategy; s != nil {
			clusterStrategy = *s
		}
	}
	nodes, err := c.cfg.Kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for _, n := range nodes.Items {
		if !hasTaint(&n, key) {
			continue
		}
		vmis, err := c.cfg.Virt.VMIs.List(ctx, metav1.NamespaceAll, metav1.ListOptions{LabelSelector: kubevirtv1.NodeNameLabel + "=" + n.Name})
		if err != nil {
			return err
		}
		for _, vmi := range vmis {
			if vmi.Status.NodeName != n.Name || vmi.IsFinal() || vmi.DeletionTimestamp != nil {
				continue
			}
			strategy := clusterStrategy
			if vmi.Spec.EvictionStrategy != nil {
				strategy = *vmi.Spec.EvictionStrategy
			}
			if err := c.evacuateVMI(ctx, vmi, n.Name, strategy); err != nil {
				c.log.Warn("evacuation", "vmi", vmi.Namespace+"/"+vmi.Name, "node", n.Name, "err", err)
			}
		}
	}
	return nil
}

func (c *Controller) evacuateVMI(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, node string, strategy kubevirtv1.EvictionStrategy) error {
	switch strategy {
	case kubevirtv1.EvictionStrategyNone:
		return nil
	case kubevirtv1.EvictionStrategyExternal:
		return c.markEvacuating(ctx, vmi, node)
	}
	if why := Refusal(vmi, vmi.Name); why != "" {
		if vmi.Status.EvacuationNodeName != node {
			c.recorder.Eventf(vmi, corev1.EventTypeWarning, ReasonFailedEvacuation, "node %s is draining and the VMI cannot migrate: %s", node, why)
			return c.markEvacuating(ctx, vmi, node)
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

// markEvacuating sets status.evacuationNodeName.
func (c *Controller) markEvacuating(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, node string) error {
	if vmi.Status.EvacuationNodeName == node {
		return nil
	}
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := c.cfg.Virt.VMIs.Get(ctx, vmi.Namespace, vmi.Name)
		if err != nil {
			return err
		}
		cur.Status.EvacuationNodeName = node
		_, err = c.cfg.Virt.VMIs.UpdateStatus(ctx, cur)
		return err
	})
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key && (t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute) {
			return true
		}
	}
	return false
}
