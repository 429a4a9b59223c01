package replicas

import (
	"context"
	"fmt"
	"sort"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	poolv1beta1 "kubevirt.io/api/pool/v1beta1"
)

func (c *Controller) syncPool(ctx context.Context, key string) error {
	obj, exists, err := c.pools.GetStore().GetByKey(key)
	if err != nil || !exists {
		return err
	}
	pool := obj.(*poolv1beta1.VirtualMachinePool)
	if pool.DeletionTimestamp != nil || pool.Spec.VirtualMachineTemplate == nil || pool.Spec.Selector == nil {
		return nil
	}
	sel, err := metav1.LabelSelectorAsSelector(pool.Spec.Selector)
	if err != nil {
		return fmt.Errorf("pool %s: selector: %w", key, err)
	}
	members, err := owned[*kubevirtv1.VirtualMachine](c.cfg.VMs.GetIndexer(), pool.Namespace, pool.UID, sel)
	if err != nil {
		return err
	}
	byIndex := map[int]*kubevirtv1.VirtualMachine{}
	var indexes []int
	for _, vm := range members {
		i, ok := poolIndex(pool.Name, vm.Name)
		if !ok || vm.DeletionTimestamp != nil {
			continue
		}
		byIndex[i] = vm
		indexes = append(indexes, i)
	}
	sort.Ints(indexes)
	want := replicasOf(pool.Spec.Replicas)
	var gone, made []string
	var failed *scaleFailure
	// Scale down: the highest indexes go.
	for len(indexes) > want {
		vm := byIndex[indexes[len(indexes)-1]]
		if err := c.cfg.Virt.VMs.Delete(ctx, pool.Namespace, vm.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			c.recorder.Eventf(pool, corev1.EventTypeWarning, reasonFailedDelete, "Error deleting virtual machine %s/%s: %v", vm.Namespace, vm.Name, err)
			failed = &scaleFailure{reasonFailedScaleIn, fmt.Errorf("error during scale in: %w", err)}
			break
		}
		indexes = indexes[:len(indexes)-1]
		gone = append(gone, vm.Name)
		c.recorder.Eventf(pool, corev1.EventTypeNormal, reasonSuccessfulDelete, "Deleted VM %s/%s with uid %s from pool", vm.Namespace, vm.Name, vm.UID)
		c.cfg.Log.Info("pool vm deleted", "namespace", pool.Namespace, "pool", pool.Name, "vm", vm.Name)
	}
	// Scale up: the lowest free indexes.
	tmpl := pool.Spec.VirtualMachineTemplate
	for i := 0; failed == nil && len(indexes)+len(made) < want; i++ {
		if byIndex[i] != nil {
			continue
		}
		vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: pool.Name + "-" + strconv.Itoa(i), Namespace: pool.Namespace,
			Labels: tmpl.ObjectMeta.Labels, Annotations: tmpl.ObjectMeta.Annotations,
			OwnerReferences: controllerRef(poolv1beta1.SchemeGroupVersion.String(), poolv1beta1.VirtualMachinePoolKind, pool.Name, pool.UID)},
			Spec: *tmpl.Spec.DeepCopy()}
		_, err := c.cfg.Virt.VMs.Create(ctx, vm)
		switch {
		case apierrors.IsAlreadyExists(err):
			// Another owner's VM, or ours not yet in the cache: a later
			// sync sees which.
			continue
		case err != nil:
			c.recorder.Eventf(pool, corev1.EventTypeWarning, reasonFailedCreate, "Error creating VM: %v", err)
			failed = &scaleFailure{reasonFailedScaleOut, fmt.Errorf("error during scale out: %w", err)}
			continue
		}
		made = append(made, vm.Name)
		c.recorder.Eventf(pool, corev1.EventTypeNormal, reasonSuccessfulCreate, "Created VM %s/%s", vm.Namespace, vm.Name)
		c.cfg.Log.Info("pool vm created", "namespace", pool.Namespace, "pool", pool.Name, "vm", vm.Name)
	}
	if err := c.awaitCache(ctx, c.cfg.VMs.GetStore(), pool.Namespace, made, gone); err != nil {
		return fmt.Errorf("pool %s: %w", key, err)
	}
	ready := 0
	for _, i := range indexes {
		if byIndex[i].Status.Ready {
			ready++
		}
	}
	st := pool.Status
	st.Replicas, st.ReadyReplicas, st.LabelSelector = int32(len(indexes)+len(made)), int32(ready), sel.String()
	var added bool
	st.Conditions, added = withFailure(st.Conditions, failed, func(c poolv1beta1.VirtualMachinePoolCondition) bool {
		return c.Type == poolv1beta1.VirtualMachinePoolReplicaFailure
	}, func(reason, message string) poolv1beta1.VirtualMachinePoolCondition {
		return poolv1beta1.VirtualMachinePoolCondition{Type: poolv1beta1.VirtualMachinePoolReplicaFailure,
			Status: corev1.ConditionTrue, Reason: reason, Message: message, LastTransitionTime: metav1.Now()}
	})
	if !equality.Semantic.DeepEqual(st, pool.Status) {
		upd := pool.DeepCopy()
		upd.Status = st
		if _, err := c.cfg.Virt.VMPools.UpdateStatus(ctx, upd); err != nil {
			return fmt.Errorf("pool %s: write status: %w", key, err)
		}
	}
	if added {
		// KubeVirt's pool controller sends the condition as an Event too.
		c.recorder.Event(pool, corev1.EventTypeWarning, failed.reason, failed.err.Error())
	}
	return failed.wrap("pool " + key)
}
