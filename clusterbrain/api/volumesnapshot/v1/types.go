// Package v1 is snapshot.storage.k8s.io/v1: VolumeSnapshot,
// VolumeSnapshotContent and VolumeSnapshotClass with the JSON shape of the
// Kubernetes CSI external-snapshotter, so manifests and tools written for it
// work unchanged. nodevirt's nodeagent plays the snapshot-controller and
// csi-snapshotter for the volumes of its own node.
package v1

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/nodevirt/nodevirt/clusterbrain/api"
)

// GroupName is the API group.
const GroupName = "snapshot.storage.k8s.io"

// SchemeGroupVersion is the group and version of this package.
var SchemeGroupVersion = schema.GroupVersion{Group: GroupName, Version: "v1"}

// Resources of the group.
var (
	SnapshotsResource = SchemeGroupVersion.WithResource("volumesnapshots")
	ContentsResource  = SchemeGroupVersion.WithResource("volumesnapshotcontents")
	ClassesResource   = SchemeGroupVersion.WithResource("volumesnapshotclasses")
)

// DeletionPolicy says what happens to the storage snapshot when its
// VolumeSnapshotContent goes.
type DeletionPolicy string

// Deletion policies.
const (
	VolumeSnapshotContentDelete DeletionPolicy = "Delete"
	VolumeSnapshotContentRetain DeletionPolicy = "Retain"
)

// AnnIsDefaultClass marks the default VolumeSnapshotClass of a driver.
const AnnIsDefaultClass = "snapshot.storage.kubernetes.io/is-default-class"

// VolumeSnapshot is a user's request for a snapshot of a claim (dynamic)
// or a binding to an existing content (pre-provisioned). Namespaced.
type VolumeSnapshot struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              VolumeSnapshotSpec    `json:"spec"`
	Status            *VolumeSnapshotStatus `json:"status,omitempty"`
}

// VolumeSnapshotSpec is what is snapshotted and how.
type VolumeSnapshotSpec struct {
	Source                  VolumeSnapshotSource `json:"source"`
	VolumeSnapshotClassName *string              `json:"volumeSnapshotClassName,omitempty"`
}

// VolumeSnapshotSource names exactly one of a claim to snapshot or an
// existing content to bind.
type VolumeSnapshotSource struct {
	PersistentVolumeClaimName *string `json:"persistentVolumeClaimName,omitempty"`
	VolumeSnapshotContentName *string `json:"volumeSnapshotContentName,omitempty"`
}

// VolumeSnapshotStatus is what the snapshotter observed.
type VolumeSnapshotStatus struct {
	BoundVolumeSnapshotContentName *string              `json:"boundVolumeSnapshotContentName,omitempty"`
	CreationTime                   *metav1.Time         `json:"creationTime,omitempty"`
	ReadyToUse                     *bool                `json:"readyToUse,omitempty"`
	RestoreSize                    *resource.Quantity   `json:"restoreSize,omitempty"`
	Error                          *VolumeSnapshotError `json:"error,omitempty"`
	VolumeGroupSnapshotName        *string              `json:"volumeGroupSnapshotName,omitempty"`
}

// VolumeSnapshotError is the last error of a snapshot operation.
type VolumeSnapshotError struct {
	Time    *metav1.Time `json:"time,omitempty"`
	Message *string      `json:"message,omitempty"`
}

// VolumeSnapshotList is a list of VolumeSnapshot.
type VolumeSnapshotList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []VolumeSnapshot `json:"items"`
}

// VolumeSnapshotContent is the snapshot in the storage system.
// Cluster-scoped.
type VolumeSnapshotContent struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              VolumeSnapshotContentSpec    `json:"spec"`
	Status            *VolumeSnapshotContentStatus `json:"status,omitempty"`
}

// VolumeSnapshotContentSpec binds the content to its VolumeSnapshot.
type VolumeSnapshotContentSpec struct {
	VolumeSnapshotRef       corev1.ObjectReference       `json:"volumeSnapshotRef"`
	DeletionPolicy          DeletionPolicy               `json:"deletionPolicy"`
	Driver                  string                       `json:"driver"`
	VolumeSnapshotClassName *string                      `json:"volumeSnapshotClassName,omitempty"`
	Source                  VolumeSnapshotContentSource  `json:"source"`
	SourceVolumeMode        *corev1.PersistentVolumeMode `json:"sourceVolumeMode,omitempty"`
}

// VolumeSnapshotContentSource is the CSI volume to snapshot (dynamic) or
// the CSI snapshot that exists (pre-provisioned).
type VolumeSnapshotContentSource struct {
	VolumeHandle   *string `json:"volumeHandle,omitempty"`
	SnapshotHandle *string `json:"snapshotHandle,omitempty"`
}

// VolumeSnapshotContentStatus is what the driver reported.
type VolumeSnapshotContentStatus struct {
	SnapshotHandle *string `json:"snapshotHandle,omitempty"`
	// CreationTime is in nanoseconds since the epoch.
	CreationTime *int64 `json:"creationTime,omitempty"`
	// RestoreSize is in bytes.
	RestoreSize               *int64               `json:"restoreSize,omitempty"`
	ReadyToUse                *bool                `json:"readyToUse,omitempty"`
	Error                     *VolumeSnapshotError `json:"error,omitempty"`
	VolumeGroupSnapshotHandle *string              `json:"volumeGroupSnapshotHandle,omitempty"`
}

// VolumeSnapshotContentList is a list of VolumeSnapshotContent.
type VolumeSnapshotContentList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []VolumeSnapshotContent `json:"items"`
}

// VolumeSnapshotClass names a driver and its snapshot parameters; it has
// no spec. Cluster-scoped.
type VolumeSnapshotClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Driver            string            `json:"driver"`
	Parameters        map[string]string `json:"parameters,omitempty"`
	DeletionPolicy    DeletionPolicy    `json:"deletionPolicy"`
}

// VolumeSnapshotClassList is a list of VolumeSnapshotClass.
type VolumeSnapshotClassList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []VolumeSnapshotClass `json:"items"`
}

// DeepCopyObject implements runtime.Object.
func (in *VolumeSnapshot) DeepCopyObject() runtime.Object { return in.DeepCopy() }

// DeepCopy copies in.
func (in *VolumeSnapshot) DeepCopy() *VolumeSnapshot {
	out := new(VolumeSnapshot)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *VolumeSnapshotList) DeepCopyObject() runtime.Object {
	out := new(VolumeSnapshotList)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *VolumeSnapshotContent) DeepCopyObject() runtime.Object { return in.DeepCopy() }

// DeepCopy copies in.
func (in *VolumeSnapshotContent) DeepCopy() *VolumeSnapshotContent {
	out := new(VolumeSnapshotContent)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *VolumeSnapshotContentList) DeepCopyObject() runtime.Object {
	out := new(VolumeSnapshotContentList)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *VolumeSnapshotClass) DeepCopyObject() runtime.Object {
	out := new(VolumeSnapshotClass)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *VolumeSnapshotClassList) DeepCopyObject() runtime.Object {
	out := new(VolumeSnapshotClassList)
	api.DeepCopyJSON(in, out)
	return out
}

// AddToScheme registers this group's kinds.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &VolumeSnapshot{}, &VolumeSnapshotList{},
		&VolumeSnapshotContent{}, &VolumeSnapshotContentList{}, &VolumeSnapshotClass{}, &VolumeSnapshotClassList{})
	metav1.AddToGroupVersion(s, SchemeGroupVersion)
	return nil
}
