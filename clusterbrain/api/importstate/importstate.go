// Package importstate is the protocol between the DataVolume controller in
// the brain and the nodeagent that fills the volume: the node reports how
// the population of a PVC goes through annotations on that PVC, the brain
// reads them and alone writes the DataVolume's status.
//
// Each side owns its keys: the brain writes the PVC's spec and the keys it
// sets at creation (source, usable size); the node writes only the report
// keys below, with JSON merge patches that touch nothing else. A report
// belongs to one PVC object, so a DataVolume deleted and created again
// starts with a fresh report.
package importstate

import (
	"encoding/json"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Keys the node writes (CDI's own names where CDI has one, so that tools
// reading them — virtctl image-upload waits on pod.phase and pod.ready —
// keep working).
const (
	// AnnPhase is Pending, Running, Succeeded or Failed.
	AnnPhase = "cdi.kubevirt.io/storage.pod.phase"
	// AnnReady is "true" while an upload target accepts data.
	AnnReady = "cdi.kubevirt.io/storage.pod.ready"
	// AnnRestarts counts retried attempts.
	AnnRestarts = "cdi.kubevirt.io/storage.pod.restarts"
	// AnnReason and AnnMessage explain the last failure (or "Completed").
	AnnReason  = "cdi.kubevirt.io/storage.condition.running.reason"
	AnnMessage = "cdi.kubevirt.io/storage.condition.running.message"
	// AnnProgress is "NN.NN%".
	AnnProgress = "nodevirt.io/import.progress"
	// AnnNode names the node that fills the volume.
	AnnNode = "nodevirt.io/import.node"
)

// Keys the brain writes when it creates the PVC.
const (
	// AnnSource is the kind of source: http, registry, blank, upload, pvc,
	// snapshot or none.
	AnnSource = "cdi.kubevirt.io/storage.import.source"
	// AnnEndpoint is the URL of an http or registry source (informative).
	AnnEndpoint = "cdi.kubevirt.io/storage.import.endpoint"
	// AnnUploadTarget marks a PVC that waits for an upload (CDI's key).
	AnnUploadTarget = "cdi.kubevirt.io/storage.upload.target"
	// AnnUsableSize is the number of bytes the disk image may occupy: the
	// requested size, net of the filesystem overhead.
	AnnUsableSize = "nodevirt.io/usable-size"
	// AnnSelectedNode is Kubernetes' key for the node a WaitForFirstConsumer
	// claim is provisioned on.
	AnnSelectedNode = "volume.kubernetes.io/selected-node"
	// AnnImmediateBinding asks a DataVolume not to wait for its consumer.
	AnnImmediateBinding = "cdi.kubevirt.io/storage.bind.immediate.requested"
)

// IsBareUploadClaim says whether pvc is an upload target that no
// DataVolume owns: `virtctl image-upload pvc` makes such claims.
func IsBareUploadClaim(pvc *corev1.PersistentVolumeClaim) bool {
	_, target := pvc.Annotations[AnnUploadTarget]
	for _, ref := range pvc.OwnerReferences {
		if ref.Controller != nil && *ref.Controller && ref.Kind == "DataVolume" {
			return false
		}
	}
	return target
}

// AnnImportAllowedNetworks is the annotation of the CDI CR that lists the
// addresses imports (http, registry, containerDisk pulls) may reach
// although the nodes forbid them by default: loopback, link-local (cloud
// metadata) and the node's own addresses. Comma-separated CIDR prefixes or
// addresses, e.g. "127.0.0.0/8,192.168.122.1". The HyperConverged CR's
// annotation of the same name is copied onto the CDI CR by the brain.
const AnnImportAllowedNetworks = "nodevirt.io/import-allowed-networks"

// NodeUploadEndpoint is the Node annotation where a nodeagent publishes the
// https URL of its upload endpoint (mutual TLS).
const NodeUploadEndpoint = "nodevirt.io/upload-endpoint"

// Source kinds (values of AnnSource).
const (
	SourceHTTP     = "http"
	SourceRegistry = "registry"
	SourceBlank    = "blank"
	SourceUpload   = "upload"
	SourcePVC      = "pvc"
	SourceNone     = "none"
	// SourceSnapshot is a restore from a VolumeSnapshot: the node's
	// provisioner fills the volume when it creates it, so the node reports
	// Succeeded once the claim is bound.
	SourceSnapshot = "snapshot"
)

// Report is what the node says about one PVC.
type Report struct {
	Phase    corev1.PodPhase
	Ready    bool
	Restarts int32
	Reason   string
	Message  string
	Progress string
	Node     string
}

// Read returns the report on pvc (zero when the node has not reported).
func Read(pvc *corev1.PersistentVolumeClaim) Report {
	a := pvc.Annotations
	r := Report{
		Phase:    corev1.PodPhase(a[AnnPhase]),
		Ready:    a[AnnReady] == "true",
		Reason:   a[AnnReason],
		Message:  a[AnnMessage],
		Progress: a[AnnProgress],
		Node:     a[AnnNode],
	}
	if n, err := strconv.ParseInt(a[AnnRestarts], 10, 32); err == nil && n > 0 {
		r.Restarts = int32(n)
	}
	return r
}

// Patch is the JSON merge patch that writes r onto the PVC whose UID is
// uid (the API server refuses it on any other object of the same name).
func (r Report) Patch(uid types.UID) []byte {
	ann := map[string]any{
		AnnPhase:    string(r.Phase),
		AnnReady:    strconv.FormatBool(r.Ready),
		AnnRestarts: strconv.FormatInt(int64(r.Restarts), 10),
		AnnReason:   r.Reason,
		AnnMessage:  r.Message,
		AnnProgress: r.Progress,
		AnnNode:     r.Node,
	}
	data, _ := json.Marshal(map[string]any{"metadata": map[string]any{"uid": uid, "annotations": ann}})
	return data
}

// ProgressPatch is the merge patch that updates only the progress of the
// PVC whose UID is uid.
func ProgressPatch(uid types.UID, progress string) []byte {
	data, _ := json.Marshal(map[string]any{"metadata": map[string]any{"uid": uid, "annotations": map[string]string{AnnProgress: progress}}})
	return data
}

// UsableSize returns AnnUsableSize of pvc, or 0.
func UsableSize(pvc *corev1.PersistentVolumeClaim) int64 {
	n, err := strconv.ParseInt(pvc.Annotations[AnnUsableSize], 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// AnnCloneRequest names the clone source of a PVC as "namespace/name"
// (CDI's key), written by the brain.
const AnnCloneRequest = "k8s.io/CloneRequest"

// HostpathTopologyKey is the node label of the hostpath CSI driver.
const HostpathTopologyKey = "topology.hostpath.csi/node"

// PVNode returns the node a node-local PV lives on (its required node
// affinity on topology.hostpath.csi/node or kubernetes.io/hostname), or "".
func PVNode(pv *corev1.PersistentVolume) string {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return ""
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range term.MatchExpressions {
			if (e.Key == HostpathTopologyKey || e.Key == corev1.LabelHostname) && e.Operator == corev1.NodeSelectorOpIn && len(e.Values) == 1 {
				return e.Values[0]
			}
		}
	}
	return ""
}
