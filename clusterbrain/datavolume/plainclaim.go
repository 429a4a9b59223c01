package datavolume

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
	"github.com/nodevirt/nodevirt/clusterbrain/api/poolstate"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// A plain claim is a PVC of no DataVolume that is no bare upload claim: a
// user's claim of a class. In an Immediate class of the hostpath
// provisioners nothing else gives it a node. Upstream, the Hostpath
// Provisioner runs the CSI external-provisioner on every node it serves
// (--node-deployment, immediate binding on): each instance whose node the
// class's allowedTopologies admit writes volume.kubernetes.io/selected-node
// with its own name after a short random delay, and the first to write it
// provisions. The brain makes that choice once, by the rules and the
// scoring of a DataVolume bound at once (placeImmediately), among the nodes
// that serve the class's pool (the HostPathProvisioner's spec.workload, as
// its DaemonSet's placement); the node's provisioner then makes the volume
// where selected-node says. A clone goes to its source's node, a snapshot
// restore to the node holding the snapshot.

// plainClaimKey marks a plain claim's key in the queue.
const plainClaimKey = "claim:"

// awaitsNode reports whether pvc, a plain claim, is pending with no node
// chosen: neither selected-node nor the legacy provisioner's provisionOnNode.
func awaitsNode(pvc *corev1.PersistentVolumeClaim) bool {
	if pvc.DeletionTimestamp != nil || pvc.Spec.VolumeName != "" || (pvc.Status.Phase != "" && pvc.Status.Phase != corev1.ClaimPending) {
		return false
	}
	return pvc.Annotations[importstate.AnnSelectedNode] == "" && pvc.Annotations[annLegacyProvisionOnNode] == ""
}

// annLegacyProvisionOnNode is the legacy hostpath provisioner's own way to
// name a claim's node.
const annLegacyProvisionOnNode = "kubevirt.io/provisionOnNode"

// syncPlainClaim places one plain claim of an Immediate class of the
// hostpath provisioners; a claim no node can take gets a warning event
// saying why and is looked at again.
func (c *Controller) syncPlainClaim(ctx context.Context, key string) (time.Duration, error) {
	pvc, err := c.claimOf(key, plainClaimKey)
	if err != nil || pvc == nil {
		return 0, err
	}
	if _, owned := controller.OwnerKey(pvc, "DataVolume"); owned || importstate.IsBareUploadClaim(pvc) || !awaitsNode(pvc) {
		return 0, nil
	}
	if !placesImmediateClass(c.storageClass(deref(pvc.Spec.StorageClassName))) {
		return 0, nil // the class may come later: its creation brings the claim back
	}
	return c.placeClaim(ctx, pvc, claimSource(pvc), c.provisionerPlacement)
}

// claimSource is what a plain claim copies, as the source placeImmediately
// follows: a claim it clones, a VolumeSnapshot it restores, or nil.
func claimSource(pvc *corev1.PersistentVolumeClaim) *cdiv1.DataVolumeSource {
	ns, group, kind, name := pvc.Namespace, "", "", ""
	if ref := pvc.Spec.DataSourceRef; ref != nil {
		group, kind, name = deref(ref.APIGroup), ref.Kind, ref.Name
		if ref.Namespace != nil && *ref.Namespace != "" {
			ns = *ref.Namespace
		}
	} else if ref := pvc.Spec.DataSource; ref != nil {
		group, kind, name = deref(ref.APIGroup), ref.Kind, ref.Name
	}
	switch {
	case group == "" && kind == "PersistentVolumeClaim":
		return &cdiv1.DataVolumeSource{PVC: &cdiv1.DataVolumeSourcePVC{Namespace: ns, Name: name}}
	case group == snapshotv1.GroupName && kind == "VolumeSnapshot":
		return &cdiv1.DataVolumeSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Namespace: ns, Name: name}}
	}
	return nil
}

// provisionerPlacement is where the provisioner of sc's pool runs: the
// spec.workload of the HostPathProvisioner that defines the pool (its
// DaemonSet's placement upstream: condition taints tolerated, others only
// as the workload says). A pool no HostPathProvisioner defines (a node
// agent's --pools) is placed as by an empty workload.
func (c *Controller) provisionerPlacement(ctx context.Context, sc *storagev1.StorageClass) nodeplacement.Placement {
	placement := nodeplacement.Placement{Field: "hostpathprovisioner spec.workload", DaemonLike: true}
	pool := sc.Parameters["storagePool"]
	if pool == "" && sc.Provisioner == LegacyHostpathProvisioner {
		pool = poolstate.LegacyPoolName
	}
	hpps, err := c.virt.HostPathProvisioners.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		c.log.Info("hostpathprovisioners not listed: placing claims by an empty workload", "err", err)
		return placement
	}
	for _, hpp := range hpps {
		for _, w := range poolstate.Pools(hpp) {
			if w.Name == pool && w.Refused == "" {
				wl := hpp.Spec.Workload
				return nodeplacement.Placement{NodeSelector: wl.NodeSelector, Affinity: wl.Affinity, Tolerations: wl.Tolerations,
					Field: "hostpathprovisioner " + hpp.Name + " spec.workload", DaemonLike: true}
			}
		}
	}
	return placement
}

// enqueueClassClaims brings back the plain claims waiting for sc, a class
// that just appeared or changed.
func (c *Controller) enqueueClassClaims(obj any) {
	sc, ok := obj.(*storagev1.StorageClass)
	if !ok || !placesImmediateClass(sc) {
		return
	}
	pvcs, err := c.pvcs.List(labels.Everything())
	if err != nil {
		return
	}
	for _, pvc := range pvcs {
		if deref(pvc.Spec.StorageClassName) == sc.Name {
			c.enqueueClaim(pvc)
		}
	}
}
