package provisioner

import (
	"errors"
	"fmt"
	"strings"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	hostpath "github.com/nodevirt/nodevirt/csi"
)

// Names the provisioner shares with Kubernetes and the Hostpath Provisioner.
const (
	// CSIProvisionerName provisions CSI volumes of the hostpath driver.
	CSIProvisionerName = hostpath.DriverName
	// LegacyProvisionerName provisions hostPath PVs on the same pools.
	LegacyProvisionerName = "kubevirt.io/hostpath-provisioner"

	// AnnSelectedNode is set by the scheduler (or a VM placer) for
	// WaitForFirstConsumer claims.
	AnnSelectedNode = "volume.kubernetes.io/selected-node"
	// AnnLegacyProvisionOnNode asks the legacy provisioner for a node
	// without waiting for a consumer, as HPP's legacy provisioner did.
	AnnLegacyProvisionOnNode = "kubevirt.io/provisionOnNode"
	// AnnProvisionedBy records which provisioner made a PV.
	AnnProvisionedBy = "pv.kubernetes.io/provisioned-by"
	// AnnBetaStorageClass is the pre-spec storage class field.
	AnnBetaStorageClass = "volume.beta.kubernetes.io/storage-class"
	// AnnVolumeID records the driver's volume ID on legacy hostPath PVs.
	AnnVolumeID = "hostpath.nodevirt.io/volume-id"

	// Finalizer keeps a PV until its volume is gone.
	Finalizer = "hostpath.nodevirt.io/volume-protection"

	// hostnameKey is the node label legacy PVs are pinned with.
	hostnameKey = "kubernetes.io/hostname"
	// csiParamPrefix marks StorageClass parameters meant for sidecars.
	csiParamPrefix = "csi.storage.k8s.io/"
)

// kind tells the two provisioners apart.
type kind int

const (
	kindCSI kind = iota + 1
	kindLegacy
)

func (k kind) provisionerName() string {
	if k == kindLegacy {
		return LegacyProvisionerName
	}
	return CSIProvisionerName
}

func kindOf(provisioner string) (kind, bool) {
	switch provisioner {
	case CSIProvisionerName:
		return kindCSI, true
	case LegacyProvisionerName:
		return kindLegacy, true
	}
	return 0, false
}

// claimPlan is what to do with a claim.
type claimPlan struct {
	// Provision is false when the claim is not ours (Reason says why).
	Provision bool
	Reason    string
	Kind      kind
	// Err is a problem to report on the claim as a warning event; the
	// claim is then not provisioned.
	Err error
}

// storageClassName returns the claim's class, the beta annotation first as
// Kubernetes does.
func storageClassName(pvc *corev1.PersistentVolumeClaim) string {
	if c, ok := pvc.Annotations[AnnBetaStorageClass]; ok {
		return c
	}
	if pvc.Spec.StorageClassName != nil {
		return *pvc.Spec.StorageClassName
	}
	return ""
}

// planClaim decides whether this node provisions pvc, whose storage class
// is sc (nil when it does not exist).
func planClaim(pvc *corev1.PersistentVolumeClaim, sc *storagev1.StorageClass, node string) claimPlan {
	skip := func(format string, args ...any) claimPlan {
		return claimPlan{Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case pvc.DeletionTimestamp != nil:
		return skip("claim is being deleted")
	case pvc.Spec.VolumeName != "":
		return skip("claim is bound to %s", pvc.Spec.VolumeName)
	case pvc.Status.Phase != "" && pvc.Status.Phase != corev1.ClaimPending:
		return skip("claim is %s", pvc.Status.Phase)
	case sc == nil:
		return skip("storage class %q does not exist", storageClassName(pvc))
	}
	k, ours := kindOf(sc.Provisioner)
	if !ours {
		return skip("storage class %s belongs to %s", sc.Name, sc.Provisioner)
	}
	selected := pvc.Annotations[AnnSelectedNode]
	if selected == "" && k == kindLegacy {
		selected = pvc.Annotations[AnnLegacyProvisionOnNode]
	}
	if selected != node {
		if selected == "" {
			return skip("no node selected yet")
		}
		return skip("claim is for node %s", selected)
	}
	plan := claimPlan{Provision: true, Kind: k}
	if _, err := requestedBytes(pvc); err != nil {
		plan.Err = err
	} else if err := checkAccessModes(pvc.Spec.AccessModes); err != nil {
		plan.Err = err
	} else if k == kindLegacy && isBlock(pvc) {
		plan.Err = errors.New("the legacy provisioner serves filesystem volumes only; use the CSI storage class for block volumes")
	} else if ds := pvc.Spec.DataSourceRef; ds != nil && !isClaimSource(ds.APIGroup, ds.Kind) && !isSnapshotSource(ds.APIGroup, ds.Kind) {
		plan.Err = fmt.Errorf("data source %s %s is not supported: only PersistentVolumeClaim clones and VolumeSnapshot restores are", ds.Kind, ds.Name)
	} else if ds := pvc.Spec.DataSource; ds != nil && !isClaimSource(ds.APIGroup, ds.Kind) && !isSnapshotSource(ds.APIGroup, ds.Kind) {
		plan.Err = fmt.Errorf("data source %s %s is not supported: only PersistentVolumeClaim clones and VolumeSnapshot restores are", ds.Kind, ds.Name)
	} else if ds := pvc.Spec.DataSourceRef; ds != nil && isSnapshotSource(ds.APIGroup, ds.Kind) && ds.Namespace != nil && *ds.Namespace != "" && *ds.Namespace != pvc.Namespace {
		plan.Err = fmt.Errorf("volumesnapshot %s/%s is in another namespace: cross-namespace restores are not served", *ds.Namespace, ds.Name)
	} else if k == kindLegacy && (snapshotSource(pvc) != "" || pvc.Annotations[importstate.AnnSource] == importstate.SourceSnapshot) {
		plan.Err = errors.New("the legacy provisioner does not restore snapshots; use the CSI storage class")
	}
	return plan
}

func isSnapshotSource(group *string, kind string) bool {
	return group != nil && *group == snapshotv1.GroupName && kind == "VolumeSnapshot"
}

// snapshotSource returns the name of the VolumeSnapshot pvc restores, ""
// if none.
func snapshotSource(pvc *corev1.PersistentVolumeClaim) string {
	name, _ := snapshotv1.ClaimSource(pvc)
	return name
}

func isClaimSource(group *string, kind string) bool {
	return (group == nil || *group == "") && kind == "PersistentVolumeClaim"
}

// cloneSource returns the name of the claim pvc clones, "" if none.
func cloneSource(pvc *corev1.PersistentVolumeClaim) string {
	if ds := pvc.Spec.DataSourceRef; ds != nil && isClaimSource(ds.APIGroup, ds.Kind) {
		if ds.Namespace != nil && *ds.Namespace != "" && *ds.Namespace != pvc.Namespace {
			return "" // cross-namespace sources need a ReferenceGrant; not served
		}
		return ds.Name
	}
	if ds := pvc.Spec.DataSource; ds != nil && isClaimSource(ds.APIGroup, ds.Kind) {
		return ds.Name
	}
	return ""
}

func isBlock(pvc *corev1.PersistentVolumeClaim) bool {
	return pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock
}

// requestedBytes is the claim's storage request.
func requestedBytes(pvc *corev1.PersistentVolumeClaim) (int64, error) {
	q, ok := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if !ok || q.Sign() <= 0 {
		return 0, errors.New("claim requests no storage size")
	}
	return q.Value(), nil
}

// checkAccessModes refuses modes that need more than one node.
func checkAccessModes(modes []corev1.PersistentVolumeAccessMode) error {
	for _, m := range modes {
		switch m {
		case corev1.ReadWriteOnce, corev1.ReadWriteOncePod, corev1.ReadOnlyMany:
		default:
			return fmt.Errorf("access mode %s is not supported: volumes are local to one node", m)
		}
	}
	return nil
}

// createRequest is the CSI request that makes pvc's volume.
func createRequest(pvc *corev1.PersistentVolumeClaim, sc *storagev1.StorageClass, node, sourceVolumeID, sourceSnapshotID string) (*csispec.CreateVolumeRequest, error) {
	size, err := requestedBytes(pvc)
	if err != nil {
		return nil, err
	}
	capability := &csispec.VolumeCapability{
		AccessMode: &csispec.VolumeCapability_AccessMode{Mode: csispec.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	if isBlock(pvc) {
		capability.AccessType = &csispec.VolumeCapability_Block{Block: &csispec.VolumeCapability_BlockVolume{}}
	} else {
		capability.AccessType = &csispec.VolumeCapability_Mount{Mount: &csispec.VolumeCapability_MountVolume{}}
	}
	params := map[string]string{}
	for k, v := range sc.Parameters {
		if !strings.HasPrefix(k, csiParamPrefix) {
			params[k] = v
		}
	}
	req := &csispec.CreateVolumeRequest{
		Name:               volumeName(pvc),
		CapacityRange:      &csispec.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csispec.VolumeCapability{capability},
		Parameters:         params,
		AccessibilityRequirements: &csispec.TopologyRequirement{
			Requisite: []*csispec.Topology{{Segments: map[string]string{hostpath.TopologyKey: node}}},
			Preferred: []*csispec.Topology{{Segments: map[string]string{hostpath.TopologyKey: node}}},
		},
	}
	if sourceVolumeID != "" {
		req.VolumeContentSource = &csispec.VolumeContentSource{Type: &csispec.VolumeContentSource_Volume{
			Volume: &csispec.VolumeContentSource_VolumeSource{VolumeId: sourceVolumeID},
		}}
	}
	if sourceSnapshotID != "" {
		req.VolumeContentSource = &csispec.VolumeContentSource{Type: &csispec.VolumeContentSource_Snapshot{
			Snapshot: &csispec.VolumeContentSource_SnapshotSource{SnapshotId: sourceSnapshotID},
		}}
	}
	return req, nil
}

// volumeName is the PV (and CSI volume) name of a claim, as
// external-provisioner names them.
func volumeName(pvc *corev1.PersistentVolumeClaim) string {
	return "pvc-" + string(pvc.UID)
}

// madeVolume is what the driver made for a claim.
type madeVolume struct {
	ID            string
	CapacityBytes int64
	Context       map[string]string
	// Path is the node directory of a legacy (hostPath) volume.
	Path string
}

// buildPV is the PV for pvc's volume, pre-bound to the claim and pinned to
// the node.
func buildPV(pvc *corev1.PersistentVolumeClaim, sc *storagev1.StorageClass, node string, k kind, v madeVolume) *corev1.PersistentVolume {
	reclaim := corev1.PersistentVolumeReclaimDelete
	if sc.ReclaimPolicy != nil {
		reclaim = *sc.ReclaimPolicy
	}
	mode := corev1.PersistentVolumeFilesystem
	if isBlock(pvc) {
		mode = corev1.PersistentVolumeBlock
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        volumeName(pvc),
			Annotations: map[string]string{AnnProvisionedBy: k.provisionerName()},
			Finalizers:  []string{Finalizer},
		},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: *resource.NewQuantity(v.CapacityBytes, resource.BinarySI)},
			AccessModes:                   pvc.Spec.AccessModes,
			VolumeMode:                    &mode,
			PersistentVolumeReclaimPolicy: reclaim,
			StorageClassName:              sc.Name,
			MountOptions:                  sc.MountOptions,
			ClaimRef: &corev1.ObjectReference{
				Kind:       "PersistentVolumeClaim",
				APIVersion: "v1",
				Namespace:  pvc.Namespace,
				Name:       pvc.Name,
				UID:        pvc.UID,
			},
		},
	}
	key := hostpath.TopologyKey
	if k == kindLegacy {
		key = hostnameKey
		pv.Annotations[AnnVolumeID] = v.ID
		pv.Spec.HostPath = &corev1.HostPathVolumeSource{Path: v.Path}
	} else {
		pv.Spec.CSI = &corev1.CSIPersistentVolumeSource{
			Driver:           hostpath.DriverName,
			VolumeHandle:     v.ID,
			VolumeAttributes: v.Context,
		}
		if mode == corev1.PersistentVolumeFilesystem {
			pv.Spec.CSI.FSType = "ext4"
		}
	}
	pv.Spec.NodeAffinity = &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{
		NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
			Key: key, Operator: corev1.NodeSelectorOpIn, Values: []string{node},
		}}}},
	}}
	return pv
}

// pvVolume says whether pv is a volume this node's provisioners made, and
// which driver volume it holds.
func pvVolume(pv *corev1.PersistentVolume, node string) (id string, ours bool) {
	k, ok := kindOf(pv.Annotations[AnnProvisionedBy])
	if !ok || pinnedNode(pv) != node {
		return "", false
	}
	switch {
	case k == kindCSI && pv.Spec.CSI != nil && pv.Spec.CSI.Driver == hostpath.DriverName:
		return pv.Spec.CSI.VolumeHandle, true
	case k == kindLegacy && pv.Spec.HostPath != nil && pv.Annotations[AnnVolumeID] != "":
		return pv.Annotations[AnnVolumeID], true
	}
	return "", false
}

// pinnedNode is the single node a PV's affinity names, "" if none.
func pinnedNode(pv *corev1.PersistentVolume) string {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return ""
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range term.MatchExpressions {
			if (e.Key == hostpath.TopologyKey || e.Key == hostnameKey) && e.Operator == corev1.NodeSelectorOpIn && len(e.Values) == 1 {
				return e.Values[0]
			}
		}
	}
	return ""
}

// volumeAction is what to do with one of our PVs.
type volumeAction int

const (
	keepVolume volumeAction = iota
	// deleteVolume deletes the driver volume, then the PV.
	deleteVolume
	// releaseFinalizer removes our finalizer without touching the volume
	// (reclaim policy Retain).
	releaseFinalizer
)

// planVolume decides what happens to one of our PVs.
func planVolume(pv *corev1.PersistentVolume) volumeAction {
	deleting := pv.DeletionTimestamp != nil
	released := pv.Status.Phase == corev1.VolumeReleased
	switch {
	case pv.Status.Phase == corev1.VolumeBound || (!deleting && !released):
		// A bound PV being deleted waits for its claim to go.
		return keepVolume
	case pv.Spec.PersistentVolumeReclaimPolicy == corev1.PersistentVolumeReclaimDelete:
		if deleting && !hasFinalizer(pv) {
			return keepVolume // already handled
		}
		return deleteVolume
	case deleting && hasFinalizer(pv):
		return releaseFinalizer
	}
	return keepVolume
}

func hasFinalizer(pv *corev1.PersistentVolume) bool {
	for _, f := range pv.Finalizers {
		if f == Finalizer {
			return true
		}
	}
	return false
}
