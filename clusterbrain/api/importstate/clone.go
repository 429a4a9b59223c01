package importstate

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Clone requests: the brain alone says which volume a claim is cloned
// from. The user can write every annotation of a claim in their own
// namespace, so the node never takes a clone source from one (AnnCloneRequest
// is informative, as CDI shows it). Instead, once the DataVolume's source
// is resolved and authorized (the DataVolume webhook's SubjectAccessReview,
// see datavolume.AuthorizedSource), the brain writes a ConfigMap named
// CloneRequestName(claim UID) in its own namespace, which users cannot
// write and nodes can only read; the node that fills the claim and the
// node that exports the source both read it.
const (
	// CloneRequestPrefix starts the name of a clone request ConfigMap.
	CloneRequestPrefix = "nodevirt-clone-"
	// CloneRequestLabel marks clone request ConfigMaps (for clean-up).
	CloneRequestLabel = "nodevirt.io/clone-request"
	// CloneTargetKey is the claim to fill, "namespace/name".
	CloneTargetKey = "target"
	// CloneSourceKey is what to copy, "namespace/name": a claim, or the
	// VolumeSnapshot to restore when CloneSourceKindKey says so.
	CloneSourceKey = "source"
	// CloneSourceKindKey is the kind of the source: CloneSourceClaim (also
	// when absent) or CloneSourceSnapshot.
	CloneSourceKindKey = "sourceKind"
	// The kinds of clone sources.
	CloneSourceClaim    = "PersistentVolumeClaim"
	CloneSourceSnapshot = "VolumeSnapshot"
)

// CloneRequestName is the name of the clone request of the claim whose UID
// is uid.
func CloneRequestName(uid types.UID) string { return CloneRequestPrefix + string(uid) }

// CloneRequest is a clone the brain asked for.
type CloneRequest struct {
	TargetNamespace, TargetName string
	SourceNamespace, SourceName string
	// SourceKind is CloneSourceClaim or CloneSourceSnapshot.
	SourceKind string
}

// Data is the ConfigMap data of r.
func (r CloneRequest) Data() map[string]string {
	kind := r.SourceKind
	if kind == "" {
		kind = CloneSourceClaim
	}
	return map[string]string{
		CloneTargetKey:     r.TargetNamespace + "/" + r.TargetName,
		CloneSourceKey:     r.SourceNamespace + "/" + r.SourceName,
		CloneSourceKindKey: kind,
	}
}

// ReadCloneRequest returns the clone request cm holds for the claim pvc:
// an error when cm is not the request of that very claim (another UID, or
// a target naming another claim).
func ReadCloneRequest(cm *corev1.ConfigMap, pvc *corev1.PersistentVolumeClaim) (CloneRequest, error) {
	if cm.Name != CloneRequestName(pvc.UID) {
		return CloneRequest{}, fmt.Errorf("configmap %s is not the clone request of pvc %s/%s", cm.Name, pvc.Namespace, pvc.Name)
	}
	tns, tname, ok1 := strings.Cut(cm.Data[CloneTargetKey], "/")
	sns, sname, ok2 := strings.Cut(cm.Data[CloneSourceKey], "/")
	if !ok1 || !ok2 || tns == "" || tname == "" || sns == "" || sname == "" {
		return CloneRequest{}, fmt.Errorf("clone request %s is malformed", cm.Name)
	}
	if tns != pvc.Namespace || tname != pvc.Name {
		return CloneRequest{}, fmt.Errorf("clone request %s targets %s/%s, not pvc %s/%s", cm.Name, tns, tname, pvc.Namespace, pvc.Name)
	}
	kind := cm.Data[CloneSourceKindKey]
	switch kind {
	case "":
		kind = CloneSourceClaim
	case CloneSourceClaim, CloneSourceSnapshot:
	default:
		return CloneRequest{}, fmt.Errorf("clone request %s has an unknown source kind %q", cm.Name, kind)
	}
	return CloneRequest{TargetNamespace: tns, TargetName: tname, SourceNamespace: sns, SourceName: sname, SourceKind: kind}, nil
}
