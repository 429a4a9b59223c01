// Package v1beta1 is hostpathprovisioner.kubevirt.io/v1beta1: the
// HostPathProvisioner that names each node's storage pools.
package v1beta1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/nodevirt/nodevirt/clusterbrain/api"
)

// SchemeGroupVersion is the group and version of this package.
var SchemeGroupVersion = schema.GroupVersion{Group: "hostpathprovisioner.kubevirt.io", Version: "v1beta1"}

// HostPathProvisioner is cluster-scoped.
type HostPathProvisioner struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              HostPathProvisionerSpec   `json:"spec,omitempty"`
	Status            HostPathProvisionerStatus `json:"status,omitempty"`
}

// HostPathProvisionerList is a list of HostPathProvisioner.
type HostPathProvisionerList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []HostPathProvisioner `json:"items"`
}

// HostPathProvisionerSpec lists the pools.
type HostPathProvisionerSpec struct {
	ImagePullPolicy corev1.PullPolicy `json:"imagePullPolicy,omitempty"`
	// PathConfig is the legacy single-pool form.
	PathConfig   *PathConfig   `json:"pathConfig,omitempty"`
	StoragePools []StoragePool `json:"storagePools,omitempty"`
	Workload     NodePlacement `json:"workload,omitempty"`
	FeatureGates []string      `json:"featureGates,omitempty"`
}

// PathConfig is one directory used as the only pool.
type PathConfig struct {
	Path            string `json:"path,omitempty"`
	UseNamingPrefix bool   `json:"useNamingPrefix,omitempty"`
}

// StoragePool is a named directory on every node. Volumes live in
// <path>/csi, as upstream's CSI driver lays them out.
type StoragePool struct {
	Name        string                            `json:"name"`
	Path        string                            `json:"path"`
	PVCTemplate *corev1.PersistentVolumeClaimSpec `json:"pvcTemplate,omitempty"`
}

// NodePlacement restricts the nodes that serve the pools.
type NodePlacement struct {
	NodeSelector map[string]string   `json:"nodeSelector,omitempty"`
	Affinity     *corev1.Affinity    `json:"affinity,omitempty"`
	Tolerations  []corev1.Toleration `json:"tolerations,omitempty"`
}

// HostPathProvisionerStatus reports the pools' state.
type HostPathProvisionerStatus struct {
	api.OperatorStatus  `json:",inline"`
	StoragePoolStatuses []StoragePoolStatus `json:"storagePoolStatuses,omitempty"`
}

// StoragePoolStatus is one pool's state over the nodes that should serve
// it (upstream's shape).
type StoragePoolStatus struct {
	Name  string           `json:"name"`
	Phase StoragePoolPhase `json:"phase,omitempty"`
	// DesiredReady is how many nodes should serve the pool (the ready
	// nodes the workload placement selects).
	DesiredReady int `json:"desiredReady,omitempty"`
	// CurrentReady is how many of them serve it.
	CurrentReady int `json:"currentReady,omitempty"`
	// ClaimStatuses are the claims backing a pvcTemplate pool (none in
	// nodevirt: such pools are refused).
	ClaimStatuses []ClaimStatus `json:"claimStatuses,omitempty"`
}

// ClaimStatus is the state of one claim backing a pool.
type ClaimStatus struct {
	Name   string                             `json:"name"`
	Status corev1.PersistentVolumeClaimStatus `json:"status"`
}

// StoragePoolPhase is a pool's phase.
type StoragePoolPhase string

// Upstream's phases, and nodevirt's for a pool it will not serve.
const (
	StoragePoolPreparing StoragePoolPhase = "Preparing"
	StoragePoolMounting  StoragePoolPhase = "Mounting"
	StoragePoolReady     StoragePoolPhase = "Ready"
	// StoragePoolRefused: the pool's definition cannot be served (a
	// pvcTemplate, an invalid name or path); the Degraded condition says
	// why.
	StoragePoolRefused StoragePoolPhase = "Refused"
)

// DeepCopyObject implements runtime.Object.
func (in *HostPathProvisioner) DeepCopyObject() runtime.Object {
	out := new(HostPathProvisioner)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *HostPathProvisionerList) DeepCopyObject() runtime.Object {
	out := new(HostPathProvisionerList)
	api.DeepCopyJSON(in, out)
	return out
}
