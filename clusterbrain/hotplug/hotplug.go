// Package hotplug holds what the brain decides when a volume is
// hot-plugged into a running VMI, whichever way it was asked: through the
// addvolume/removevolume subresources, or by an edit of a running VM's
// spec.template under KubeVirt's declarative volume hotplug. Place says
// whether the volume's claim is, or can be put, on the VMI's node;
// Declare says which hotplugged volumes and disks the VMI should have
// for its VM's template, and why a template change cannot be applied live.
//
// The node agent running the VMI does the plugging: it attaches the
// hotpluggable volumes its VMI's spec gains and detaches those it loses
// (nodeagent/handler), on the domain's virtio-scsi controller.
package hotplug

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// Bus is the one bus hotplugged disks may use here: the node puts them on
// the domain's virtio-scsi controller (no spare PCIe ports for virtio).
const Bus = kubevirtv1.DiskBusSCSI

// Hotpluggable reports whether vol is a DataVolume or claim marked
// hotpluggable.
func Hotpluggable(vol kubevirtv1.Volume) bool {
	return (vol.DataVolume != nil && vol.DataVolume.Hotpluggable) ||
		(vol.PersistentVolumeClaim != nil && vol.PersistentVolumeClaim.Hotpluggable)
}

// SourceName is the claim or DataVolume a volume names ("" for others).
func SourceName(vol kubevirtv1.Volume) string {
	switch {
	case vol.DataVolume != nil:
		return vol.DataVolume.Name
	case vol.PersistentVolumeClaim != nil:
		return vol.PersistentVolumeClaim.ClaimName
	}
	return ""
}

// Refusal is why a volume cannot be plugged into a VMI where it runs. The
// subresources answer it as a 400; the VM controller reports it on the VM.
type Refusal struct{ msg string }

func (r *Refusal) Error() string { return r.msg }

// Place makes sure the claim vol names is, or will be, on the node vmi
// runs on: a bound claim's volume must be there; a claim waiting for its
// first consumer is given that node (unless it names another; not on a
// dry run). It returns a *Refusal saying what to do for anything else, or
// the API error that kept it from deciding.
func Place(ctx context.Context, kube kubernetes.Interface, vmi *kubevirtv1.VirtualMachineInstance, vol kubevirtv1.Volume, dryRun bool) error {
	node, name := vmi.Status.NodeName, SourceName(vol)
	what := "persistentvolumeclaim"
	if vol.DataVolume != nil {
		what = "datavolume"
	}
	refuse := func(format string, args ...any) error {
		return &Refusal{fmt.Sprintf("Unable to add volume [%s]: ", vol.Name) + fmt.Sprintf(format, args...)}
	}
	pvc, err := kube.CoreV1().PersistentVolumeClaims(vmi.Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if what == "datavolume" {
			return refuse("datavolume %s has no persistentvolumeclaim yet; add it once the DataVolume's claim exists", name)
		}
		return refuse("persistentvolumeclaim %s does not exist", name)
	}
	if err != nil {
		return fmt.Errorf("persistentvolumeclaim %s: %w", name, err)
	}
	if pvc.Spec.VolumeName != "" {
		pv, err := kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("persistentvolume %s of claim %s: %w", pvc.Spec.VolumeName, name, err)
		}
		if on := importstate.PVNode(pv); on != "" && on != node {
			return refuse("%s %s is on node %s and the VMI runs on node %s: a node-local volume can only be hotplugged on its own node", what, name, on, node)
		}
		return nil
	}
	if on := pvc.Annotations[importstate.AnnSelectedNode]; on != "" {
		if on != node {
			return refuse("%s %s is placed on node %s and the VMI runs on node %s: a node-local volume can only be hotplugged on its own node", what, name, on, node)
		}
		return nil
	}
	if !waitsForConsumer(ctx, kube, pvc) {
		return refuse("%s %s is not bound yet; add it once it is", what, name)
	}
	if dryRun {
		return nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{importstate.AnnSelectedNode: node}}})
	if _, err := kube.CoreV1().PersistentVolumeClaims(vmi.Namespace).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("place claim %s on node %s: %w", name, node, err)
	}
	return nil
}

// waitsForConsumer reports whether pvc's storage class (or the default
// class) binds WaitForFirstConsumer.
func waitsForConsumer(ctx context.Context, kube kubernetes.Interface, pvc *corev1.PersistentVolumeClaim) bool {
	var sc *storagev1.StorageClass
	if n := pvc.Spec.StorageClassName; n != nil {
		if *n == "" {
			return false
		}
		got, err := kube.StorageV1().StorageClasses().Get(ctx, *n, metav1.GetOptions{})
		if err != nil {
			return false
		}
		sc = got
	} else {
		list, err := kube.StorageV1().StorageClasses().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for i := range list.Items {
			if list.Items[i].Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
				sc = &list.Items[i]
			}
		}
	}
	return sc != nil && sc.VolumeBindingMode != nil && *sc.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer
}
