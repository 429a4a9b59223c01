package scheduler

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
)

// volumeConstraints adds to req what the VMI's claims require: bound
// claims pin it to their PV's node affinity; unbound claims of a
// WaitForFirstConsumer class are returned so the decision can be written
// into them (and respect the class's allowed topologies). A claim that is
// missing or waits for immediate binding returns an error saying so.
func (s *Scheduler) volumeConstraints(vmi *kubevirtv1.VirtualMachineInstance, req *request, snaps snapshotNodes) ([]*corev1.PersistentVolumeClaim, error) {
	var wffc []*corev1.PersistentVolumeClaim
	for _, v := range vmi.Spec.Volumes {
		var claim, what string
		switch {
		case v.PersistentVolumeClaim != nil:
			claim, what = v.PersistentVolumeClaim.ClaimName, "persistentvolumeclaim"
		case v.DataVolume != nil:
			claim, what = v.DataVolume.Name, "datavolume"
		default:
			continue
		}
		pvc, err := s.pvcs.PersistentVolumeClaims(vmi.Namespace).Get(claim)
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("%s %s has no persistentvolumeclaim yet", what, claim)
		}
		if err != nil {
			return nil, err
		}
		if pvc.Spec.VolumeName != "" {
			pv, err := s.pvs.Get(pvc.Spec.VolumeName)
			if err != nil {
				return nil, fmt.Errorf("persistentvolume %s of claim %s: %w", pvc.Spec.VolumeName, claim, err)
			}
			if na := pv.Spec.NodeAffinity; na != nil && na.Required != nil {
				req.volumes = append(req.volumes, na.Required)
				req.volumeOf = append(req.volumeOf, fmt.Sprintf("volume %s: %s %s", v.Name, what, claim))
			}
			continue
		}
		sc := s.classOf(pvc)
		if sc == nil || sc.VolumeBindingMode == nil || *sc.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
			return nil, fmt.Errorf("persistentvolumeclaim %s is not bound yet", claim)
		}
		if node := pvc.Annotations[SelectedNodeAnno]; node != "" {
			if req.pinned != "" && req.pinned != node {
				return nil, fmt.Errorf("claims were given to different nodes (%s, %s)", req.pinned, node)
			}
			req.pinned, req.pinnedBy = node, fmt.Sprintf("volume %s: %s %s", v.Name, what, claim)
		} else {
			// A claim restored from a snapshot is provisioned where the
			// snapshot is kept: the VMI goes there.
			node, err := snaps.nodeOf(pvc)
			if err != nil {
				return nil, fmt.Errorf("persistentvolumeclaim %s: %w", claim, err)
			}
			if node != "" {
				if req.pinned != "" && req.pinned != node {
					return nil, fmt.Errorf("claims are held by different nodes (%s, %s)", req.pinned, node)
				}
				req.pinned, req.pinnedBy = node, fmt.Sprintf("volume %s: %s %s", v.Name, what, claim)
			}
			wffc = append(wffc, pvc)
		}
		if sel := nodeplacement.AllowedTopologies(sc); sel != nil {
			req.volumes = append(req.volumes, sel)
			req.volumeOf = append(req.volumeOf, fmt.Sprintf("volume %s: storage class %s", v.Name, sc.Name))
		}
	}
	return wffc, nil
}

// classOf returns the claim's storage class, or the default class.
func (s *Scheduler) classOf(pvc *corev1.PersistentVolumeClaim) *storagev1.StorageClass {
	if n := pvc.Spec.StorageClassName; n != nil {
		if *n == "" {
			return nil
		}
		sc, err := s.scs.Get(*n)
		if err != nil {
			return nil
		}
		return sc
	}
	all, _ := s.scs.List(labels.Everything())
	for _, sc := range all {
		if sc.Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
			return sc
		}
	}
	return nil
}

// snapshotNodes are the nodes keeping the VolumeSnapshots a VMI's unbound
// claims restore from, by claim name, looked up before the decision.
type snapshotNodes map[string]snapshotNode

type snapshotNode struct {
	node string
	err  error
}

// nodeOf is the node keeping the VolumeSnapshot pvc restores from, "" when
// it restores from none. A snapshot not ready yet, or not looked up before
// the decision (the claim changed since), is an error: the VMI waits.
func (sn snapshotNodes) nodeOf(pvc *corev1.PersistentVolumeClaim) (string, error) {
	name, _ := snapshotv1.ClaimSource(pvc)
	if name == "" {
		return "", nil
	}
	r, ok := sn[pvc.Name]
	if !ok {
		return "", fmt.Errorf("volumesnapshot %s is not located yet", name)
	}
	return r.node, r.err
}

// locateSnapshots looks up (API reads, 10 s at most each) where the
// VolumeSnapshots that vmi's unbound claims restore from are kept. Without
// a locator such claims are placed like any other.
func (s *Scheduler) locateSnapshots(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) snapshotNodes {
	out := snapshotNodes{}
	for _, v := range vmi.Spec.Volumes {
		var claim string
		switch {
		case v.PersistentVolumeClaim != nil:
			claim = v.PersistentVolumeClaim.ClaimName
		case v.DataVolume != nil:
			claim = v.DataVolume.Name
		default:
			continue
		}
		pvc, err := s.pvcs.PersistentVolumeClaims(vmi.Namespace).Get(claim)
		if err != nil || pvc.Spec.VolumeName != "" {
			continue
		}
		name, sameNamespace := snapshotv1.ClaimSource(pvc)
		switch {
		case name == "":
			continue
		case s.cfg.Snapshots == nil:
			out[claim] = snapshotNode{}
		case !sameNamespace:
			out[claim] = snapshotNode{err: fmt.Errorf("restores volumesnapshot %s of another namespace", name)}
		default:
			out[claim] = s.locate(ctx, pvc.Namespace, name)
		}
	}
	return out
}

func (s *Scheduler) locate(ctx context.Context, namespace, name string) snapshotNode {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	loc, err := s.cfg.Snapshots.Locate(ctx, namespace, name)
	if err != nil {
		return snapshotNode{err: err}
	}
	if !loc.Ready || loc.Node == "" {
		return snapshotNode{err: fmt.Errorf("volumesnapshot %s is not ready to restore yet", name)}
	}
	return snapshotNode{node: loc.Node}
}
