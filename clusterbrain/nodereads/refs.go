package nodereads

import (
	"context"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// AnnProvisionOnNode is KubeVirt's placement annotation of a claim, which
// the node restriction treats as AnnSelectedNode.
const AnnProvisionOnNode = "kubevirt.io/provisionOnNode"

// names are the Secrets and ConfigMaps an object refers to.
type names struct {
	secrets, configMaps []string
}

func (n *names) secret(name string) {
	if name != "" {
		n.secrets = append(n.secrets, name)
	}
}

func (n *names) configMap(name string) {
	if name != "" {
		n.configMaps = append(n.configMaps, name)
	}
}

// vmiNames are what a VMI's spec names, as the Node authorizer takes every
// reference of a pod's spec: cloud-init user and network data, secret and
// configMap volumes, containerDisk pull secrets, sysprep, access
// credentials.
func vmiNames(vmi *kubevirtv1.VirtualMachineInstance) names {
	var n names
	ref := func(r *corev1.LocalObjectReference) string {
		if r == nil {
			return ""
		}
		return r.Name
	}
	for _, v := range vmi.Spec.Volumes {
		if s := v.CloudInitNoCloud; s != nil {
			n.secret(ref(s.UserDataSecretRef))
			n.secret(ref(s.NetworkDataSecretRef))
		}
		if s := v.CloudInitConfigDrive; s != nil {
			n.secret(ref(s.UserDataSecretRef))
			n.secret(ref(s.NetworkDataSecretRef))
		}
		if s := v.Secret; s != nil {
			n.secret(s.SecretName)
		}
		if s := v.ConfigMap; s != nil {
			n.configMap(s.Name)
		}
		if s := v.ContainerDisk; s != nil {
			n.secret(s.ImagePullSecret)
		}
		if s := v.Sysprep; s != nil {
			n.secret(ref(s.Secret))
			n.configMap(ref(s.ConfigMap))
		}
	}
	for _, c := range vmi.Spec.AccessCredentials {
		if k := c.SSHPublicKey; k != nil && k.Source.Secret != nil {
			n.secret(k.Source.Secret.SecretName)
		}
		if p := c.UserPassword; p != nil && p.Source.Secret != nil {
			n.secret(p.Source.Secret.SecretName)
		}
	}
	return n
}

// dataVolumeNames are what a DataVolume's import source names.
func dataVolumeNames(dv *cdiv1.DataVolume) names {
	var n names
	src := dv.Spec.Source
	if src == nil {
		return n
	}
	if h := src.HTTP; h != nil {
		n.secret(h.SecretRef)
		for _, s := range h.SecretExtraHeaders {
			n.secret(s)
		}
		n.configMap(h.CertConfigMap)
	}
	if r := src.Registry; r != nil {
		if r.SecretRef != nil {
			n.secret(*r.SecretRef)
		}
		if r.CertConfigMap != nil {
			n.configMap(*r.CertConfigMap)
		}
	}
	return n
}

// onNode says whether vmi is the node's: bound to it (status.nodeName, or
// before that the kubevirt.io/nodeName label the brain sets at creation),
// or the target of one of its migrations that has not ended.
func (s *Server) vmiOnNode(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, node string) (bool, error) {
	if vmi.Status.NodeName != "" {
		if vmi.Status.NodeName == node {
			return true, nil
		}
	} else if vmi.Labels[kubevirtv1.NodeNameLabel] == node {
		return true, nil
	}
	migs, err := s.cfg.Virt.Migrations.List(ctx, vmi.Namespace, metav1.ListOptions{})
	if err != nil {
		return false, err
	}
	for _, m := range migs {
		st := m.Status.MigrationState
		if m.Spec.VMIName == vmi.Name && st != nil && st.TargetNode == node && !st.Completed && !st.Failed &&
			m.Status.Phase != kubevirtv1.MigrationSucceeded && m.Status.Phase != kubevirtv1.MigrationFailed {
			return true, nil
		}
	}
	return false, nil
}

// claimNode is the node a claim's volume is on: its placement annotation
// (which users may set, nodes may not change) and, once bound, its
// PersistentVolume's node; "" when neither says, or when they disagree (a
// volume another node pre-bound to someone's pending claim does not make
// the claim that node's).
func (s *Server) claimNode(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (string, error) {
	placed := pvc.Annotations[importstate.AnnSelectedNode]
	if placed == "" {
		placed = pvc.Annotations[AnnProvisionOnNode]
	}
	if pvc.Spec.VolumeName == "" {
		return placed, nil
	}
	pv, err := s.cfg.Kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	if ref := pv.Spec.ClaimRef; ref == nil || ref.UID != pvc.UID {
		return "", nil
	}
	onPV := importstate.PVNode(pv)
	if placed != "" && onPV != placed {
		return "", nil
	}
	return onPV, nil
}

// claimOnNode says whether the claim namespace/name is on node.
func (s *Server) claimOnNode(ctx context.Context, namespace, name, node string) (*corev1.PersistentVolumeClaim, bool, error) {
	pvc, err := s.cfg.Kube.CoreV1().PersistentVolumeClaims(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, false, err
	}
	on, err := s.claimNode(ctx, pvc)
	return pvc, err == nil && on != "" && on == node, err
}

func contains(list []string, name string) bool { return slices.Contains(list, name) }
