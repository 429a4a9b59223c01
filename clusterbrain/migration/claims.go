package migration

import (
	"context"
	"fmt"
	"maps"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
)

// Annotations the PV controller writes on a bound claim; a replacement
// claim starts without them.
var bindAnnotations = []string{"pv.kubernetes.io/bind-completed", "pv.kubernetes.io/bound-by-controller"}

// moveClaims rebinds the claims of the node-local disks a successful
// migration copied: each claim is replaced by one of the same name, labels,
// annotations and owner bound to the PersistentVolume the target node made
// (migstate.TargetVolumeName). It reports done once every claim is bound
// there; meanwhile the claim's DataVolume carries migstate.AnnClaimMoving.
func (c *Controller) moveClaims(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance) (bool, error) {
	done := true
	for _, vol := range vmi.Spec.Volumes {
		var claim string
		isDV := false
		switch {
		case vol.PersistentVolumeClaim != nil:
			claim = vol.PersistentVolumeClaim.ClaimName
		case vol.DataVolume != nil:
			claim, isDV = vol.DataVolume.Name, true
		default:
			continue
		}
		ok, err := c.moveClaim(ctx, mig, vmi.Namespace, claim, vol.Name, isDV)
		if err != nil {
			return false, fmt.Errorf("claim %s/%s: %w", vmi.Namespace, claim, err)
		}
		done = done && ok
	}
	return done, nil
}

func (c *Controller) moveClaim(ctx context.Context, mig *kubevirtv1.VirtualMachineInstanceMigration, ns, claim, volume string, isDV bool) (bool, error) {
	st := mig.Status.MigrationState
	want := migstate.TargetVolumeName(mig.UID, volume)
	pvs := c.cfg.Kube.CoreV1().PersistentVolumes()
	pvcs := c.cfg.Kube.CoreV1().PersistentVolumeClaims(ns)
	pvc, err := pvcs.Get(ctx, claim, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return false, err
	}
	if err == nil && pvc.DeletionTimestamp == nil {
		if pvc.Spec.VolumeName == want {
			return true, c.markMoving(ctx, ns, claim, isDV, "")
		}
		old, err := pvs.Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if pinnedTo(old) != st.SourceNode || st.SourceNode == "" {
			return true, nil // shared, or not the source's: nothing moved
		}
		if _, err := pvs.Get(ctx, want, metav1.GetOptions{}); apierrors.IsNotFound(err) {
			return false, nil // the target node makes it
		} else if err != nil {
			return false, err
		}
		if err := c.markMoving(ctx, ns, claim, isDV, string(mig.UID)); err != nil {
			return false, err
		}
		c.replacements.Store(types.NamespacedName{Namespace: ns, Name: claim}, replacementOf(pvc, want, st.TargetNode))
		uid := pvc.UID
		if err := pvcs.Delete(ctx, claim, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil && !apierrors.IsNotFound(err) {
			return false, err
		}
		c.log.Info("replacing claim", "claim", ns+"/"+claim, "from", pvc.Spec.VolumeName, "to", want)
		return false, nil
	}
	if err == nil {
		return false, nil // being deleted (kubernetes.io/pvc-protection)
	}
	// Gone: its replacement, as prepared, or made from the target's PV
	// after a restart of the brain.
	pv, err := pvs.Get(ctx, want, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	if pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != ns || pv.Spec.ClaimRef.Name != claim {
		return false, fmt.Errorf("persistentvolume %s is not meant for this claim", want)
	}
	key := types.NamespacedName{Namespace: ns, Name: claim}
	var repl *corev1.PersistentVolumeClaim
	if v, ok := c.replacements.Load(key); ok {
		repl = v.(*corev1.PersistentVolumeClaim).DeepCopy()
	} else {
		repl = claimFromPV(pv, ns, claim, st.TargetNode)
		if isDV {
			dv, err := c.cfg.Virt.DataVolumes.Get(ctx, ns, claim)
			if err != nil {
				return false, fmt.Errorf("datavolume: %w", err)
			}
			repl.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(dv, dv.GroupVersionKind())}
			repl.OwnerReferences[0].APIVersion, repl.OwnerReferences[0].Kind = "cdi.kubevirt.io/v1beta1", "DataVolume"
		}
	}
	if _, err := pvcs.Create(ctx, repl, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return false, err
	}
	c.replacements.Delete(key)
	c.log.Info("claim replaced", "claim", ns+"/"+claim, "pv", want, "node", st.TargetNode)
	c.recorder.Eventf(mig, corev1.EventTypeNormal, "ClaimMoved", "Claim %s now binds volume %s on node %s", claim, want, st.TargetNode)
	return false, nil
}

// replacementOf is old as made again for the volume want on node.
func replacementOf(old *corev1.PersistentVolumeClaim, want, node string) *corev1.PersistentVolumeClaim {
	ann := maps.Clone(old.Annotations)
	if ann == nil {
		ann = map[string]string{}
	}
	for _, a := range bindAnnotations {
		delete(ann, a)
	}
	ann[importstate.AnnSelectedNode] = node
	out := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: old.Name, Namespace: old.Namespace, Labels: maps.Clone(old.Labels), Annotations: ann,
			OwnerReferences: old.OwnerReferences},
		Spec: *old.Spec.DeepCopy(),
	}
	out.Spec.VolumeName = want
	return out
}

// claimFromPV is a claim for pv when the original is lost: its size, modes
// and class, its import marked done (the data came with the migration).
func claimFromPV(pv *corev1.PersistentVolume, ns, name, node string) *corev1.PersistentVolumeClaim {
	class := pv.Spec.StorageClassName
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: map[string]string{
			importstate.AnnSelectedNode: node, importstate.AnnPhase: string(corev1.PodSucceeded)}},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: pv.Spec.AccessModes, VolumeMode: pv.Spec.VolumeMode,
			StorageClassName: &class, VolumeName: pv.Name,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: pv.Spec.Capacity[corev1.ResourceStorage]}}},
	}
}

// markMoving sets (uid non-empty) or removes migstate.AnnClaimMoving on the
// claim's DataVolume.
func (c *Controller) markMoving(ctx context.Context, ns, name string, isDV bool, uid string) error {
	if !isDV {
		return nil
	}
	dv, err := c.cfg.Virt.DataVolumes.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if dv.Annotations[migstate.AnnClaimMoving] == uid {
		return nil
	}
	dv = dv.DeepCopy()
	if uid == "" {
		delete(dv.Annotations, migstate.AnnClaimMoving)
	} else {
		if dv.Annotations == nil {
			dv.Annotations = map[string]string{}
		}
		dv.Annotations[migstate.AnnClaimMoving] = uid
	}
	_, err = c.cfg.Virt.DataVolumes.Update(ctx, dv)
	return err
}

// pinnedTo is the one node a PV's required affinity names, "" if none.
func pinnedTo(pv *corev1.PersistentVolume) string {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return ""
	}
	node := ""
	for _, t := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range t.MatchExpressions {
			if e.Operator == corev1.NodeSelectorOpIn && len(e.Values) == 1 {
				node = e.Values[0]
			}
		}
	}
	return node
}
