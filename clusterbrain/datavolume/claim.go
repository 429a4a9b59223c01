package datavolume

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
)

// claimError is a reason the PVC cannot be made (yet), shown as the Bound
// condition of the DataVolume.
type claimError struct {
	reason string
	err    error
	// fatal fails the DataVolume: waiting cannot help.
	fatal bool
}

func (e *claimError) Error() string { return e.err.Error() }
func (e *claimError) Unwrap() error { return e.err }

func claimErrorf(reason, format string, args ...any) *claimError {
	return &claimError{reason: reason, err: fmt.Errorf(format, args...)}
}

// resolveSource returns the DataVolume's effective source: spec.source, or
// what spec.sourceRef's DataSource points at.
func (c *Controller) resolveSource(ctx context.Context, dv *cdiv1.DataVolume) (*cdiv1.DataVolumeSource, error) {
	if dv.Spec.SourceRef == nil {
		return dv.Spec.Source, nil
	}
	ref := dv.Spec.SourceRef
	if ref.Kind != cdiv1.DataVolumeDataSource {
		return nil, claimErrorf("UnsupportedSourceRef", "source reference kind %q is not supported", ref.Kind)
	}
	ns := dv.Namespace
	if ref.Namespace != nil && *ref.Namespace != "" {
		ns = *ref.Namespace
	}
	name := ref.Name
	for range 4 { // a DataSource may point at another, not forever
		ds, err := c.virt.DataSources.Get(ctx, ns, name)
		if apierrors.IsNotFound(err) {
			return nil, claimErrorf("DataSourceNotFound", "datasource %s/%s not found", ns, name)
		}
		if err != nil {
			return nil, fmt.Errorf("get datasource %s/%s: %w", ns, name, err)
		}
		src := ds.Spec.Source
		switch {
		case src.PVC != nil:
			pvc := *src.PVC
			if pvc.Namespace == "" {
				pvc.Namespace = ds.Namespace
			}
			return &cdiv1.DataVolumeSource{PVC: &pvc}, nil
		case src.Snapshot != nil:
			snap := *src.Snapshot
			if snap.Namespace == "" {
				snap.Namespace = ds.Namespace
			}
			return &cdiv1.DataVolumeSource{Snapshot: &snap}, nil
		case src.DataSource != nil:
			if src.DataSource.Namespace != "" {
				ns = src.DataSource.Namespace
			}
			name = src.DataSource.Name
		default:
			return nil, claimErrorf("DataSourceEmpty", "datasource %s/%s has no source", ns, name)
		}
	}
	return nil, claimErrorf("DataSourceLoop", "datasource %s/%s: too many datasource references", ns, name)
}

// sourceKind is the importstate source kind of src.
func sourceKind(src *cdiv1.DataVolumeSource) string {
	switch {
	case src == nil:
		return importstate.SourceNone
	case src.HTTP != nil:
		return importstate.SourceHTTP
	case src.Registry != nil:
		return importstate.SourceRegistry
	case src.Blank != nil:
		return importstate.SourceBlank
	case src.Upload != nil:
		return importstate.SourceUpload
	case src.PVC != nil:
		return importstate.SourcePVC
	case src.Snapshot != nil:
		return importstate.SourceSnapshot
	case src.S3 != nil:
		return "s3"
	case src.GCS != nil:
		return "gcs"
	case src.Imageio != nil:
		return "imageio"
	case src.VDDK != nil:
		return "vddk"
	}
	return importstate.SourceNone
}

// supportedKinds are the sources the nodeagent can fill a volume from.
var supportedKinds = map[string]bool{
	importstate.SourceNone: true, importstate.SourceHTTP: true, importstate.SourceRegistry: true,
	importstate.SourceBlank: true, importstate.SourceUpload: true, importstate.SourcePVC: true,
	importstate.SourceSnapshot: true,
}

// buildClaim makes the PVC of dv.
func (c *Controller) buildClaim(ctx context.Context, dv *cdiv1.DataVolume, src *cdiv1.DataVolumeSource) (*corev1.PersistentVolumeClaim, error) {
	var spec corev1.PersistentVolumeClaimSpec
	inflate := false
	switch {
	case dv.Spec.PVC != nil:
		spec = *dv.Spec.PVC.DeepCopy()
	case dv.Spec.Storage != nil:
		s := dv.Spec.Storage
		spec = corev1.PersistentVolumeClaimSpec{
			AccessModes: s.AccessModes, Selector: s.Selector, Resources: *s.Resources.DeepCopy(),
			VolumeName: s.VolumeName, StorageClassName: s.StorageClassName, DataSource: s.DataSource, DataSourceRef: s.DataSourceRef,
		}
		if s.VolumeMode != nil && *s.VolumeMode != cdiv1.PersistentVolumeFromStorageProfile {
			mode := *s.VolumeMode
			spec.VolumeMode = &mode
		}
		inflate = true
	default:
		return nil, claimErrorf("ErrClaimNotValid", "datavolume has neither spec.pvc nor spec.storage")
	}
	if spec.StorageClassName == nil {
		if sc := c.defaultStorageClass(); sc != nil {
			spec.StorageClassName = &sc.Name
		}
	}
	className := ""
	if spec.StorageClassName != nil {
		className = *spec.StorageClassName
	}
	if inflate {
		c.applyProfile(ctx, &spec, className)
	}
	if spec.VolumeMode == nil {
		mode := corev1.PersistentVolumeFilesystem
		spec.VolumeMode = &mode
	}
	var restore int64
	restoreNode := ""
	if src != nil && src.Snapshot != nil {
		loc, err := c.snapshotSource(ctx, src)
		if err != nil {
			return nil, err
		}
		restore = loc.RestoreSize
		if src.Snapshot.Namespace == dv.Namespace {
			snapshotDataSource(&spec, src.Snapshot.Name)
		}
		// From another namespace, the claim names no source: it is placed
		// at once on the node holding the snapshot (the only one that can
		// restore it, and no scheduler sees a source to follow), which
		// restores what the brain's clone request says.
		if src.Snapshot.Namespace != dv.Namespace {
			restoreNode = loc.Node
		}
	}
	size, ok := spec.Resources.Requests[corev1.ResourceStorage]
	if !ok && restore > 0 {
		// The snapshot's size is the volume's: no overhead to add.
		size, ok, inflate = *resource.NewQuantity(restore, resource.BinarySI), true, false
	}
	if !ok && src != nil && src.PVC != nil {
		srcPVC, err := c.kube.CoreV1().PersistentVolumeClaims(src.PVC.Namespace).Get(ctx, src.PVC.Name, metav1.GetOptions{})
		if err != nil {
			return nil, claimErrorf("CloneSourceNotFound", "clone source pvc %s/%s: %w", src.PVC.Namespace, src.PVC.Name, err)
		}
		size, ok = srcPVC.Spec.Resources.Requests[corev1.ResourceStorage]
	}
	if !ok || size.Value() <= 0 {
		return nil, claimErrorf("ErrClaimNotValid", "datavolume requests no storage size")
	}
	usable := size.Value()
	if *spec.VolumeMode == corev1.PersistentVolumeFilesystem {
		overhead := c.filesystemOverhead(ctx, className)
		if inflate {
			size = *resource.NewQuantity(importstate.SizeFor(usable, overhead), resource.BinarySI)
		} else {
			usable = importstate.UsableOf(usable, overhead)
		}
	}
	if size.Value() < restore {
		return nil, &claimError{reason: "SnapshotTooLarge", fatal: true, err: fmt.Errorf(
			"requested size %s is smaller than the restore size %s of volumesnapshot %s/%s", size.String(),
			resource.NewQuantity(restore, resource.BinarySI).String(), src.Snapshot.Namespace, src.Snapshot.Name)}
	}
	if spec.Resources.Requests == nil {
		spec.Resources.Requests = corev1.ResourceList{}
	}
	spec.Resources.Requests[corev1.ResourceStorage] = size

	kind := sourceKind(src)
	ann := map[string]string{
		importstate.AnnSource:     kind,
		importstate.AnnUsableSize: strconv.FormatInt(usable, 10),
	}
	switch {
	case src != nil && src.HTTP != nil:
		ann[importstate.AnnEndpoint] = src.HTTP.URL
	case src != nil && src.Registry != nil && src.Registry.URL != nil:
		ann[importstate.AnnEndpoint] = *src.Registry.URL
	case kind == importstate.SourceUpload:
		ann[importstate.AnnUploadTarget] = ""
	case src != nil && src.PVC != nil:
		ann[importstate.AnnCloneRequest] = src.PVC.Namespace + "/" + src.PVC.Name
	case src != nil && src.Snapshot != nil:
		ann[importstate.AnnEndpoint] = "volumesnapshot/" + src.Snapshot.Namespace + "/" + src.Snapshot.Name
	}
	for _, k := range []string{importstate.AnnImmediateBinding, importstate.AnnSelectedNode} {
		if v, ok := dv.Annotations[k]; ok {
			ann[k] = v
		}
	}
	if restoreNode != "" {
		ann[importstate.AnnSelectedNode] = restoreNode
	}
	labels := map[string]string{"app": "containerized-data-importer", "app.kubernetes.io/managed-by": "nodevirt"}
	for k, v := range dv.Labels {
		labels[k] = v
	}
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name: dv.Name, Namespace: dv.Namespace, Labels: labels, Annotations: ann,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(dv, cdiv1.SchemeGroupVersion.WithKind("DataVolume"))},
		},
		Spec: spec,
	}, nil
}

// defaultStorageClass is the cluster's default class (the newest when
// several claim it), or nil.
func (c *Controller) defaultStorageClass() *storagev1.StorageClass {
	list, err := c.classes.List(labels.Everything())
	if err != nil {
		return nil
	}
	var best *storagev1.StorageClass
	for _, sc := range list {
		if sc.Annotations[defaultClassAnnotation] != "true" {
			continue
		}
		if best == nil || sc.CreationTimestamp.After(best.CreationTimestamp.Time) {
			best = sc
		}
	}
	return best
}

// applyProfile fills access modes and volume mode from the class's
// StorageProfile (spec.storage only), then with RWO/Filesystem.
func (c *Controller) applyProfile(ctx context.Context, spec *corev1.PersistentVolumeClaimSpec, className string) {
	var sets []cdiv1.ClaimPropertySet
	if className != "" {
		if p, err := c.virt.StorageProfiles.Get(ctx, "", className); err == nil {
			sets = p.Status.ClaimPropertySets
		}
	}
	if len(sets) == 0 {
		sets = defaultPropertySets
	}
	pick := sets[0]
	if spec.VolumeMode != nil {
		for _, s := range sets {
			if s.VolumeMode != nil && *s.VolumeMode == *spec.VolumeMode {
				pick = s
				break
			}
		}
	}
	if len(spec.AccessModes) == 0 {
		spec.AccessModes = append([]corev1.PersistentVolumeAccessMode(nil), pick.AccessModes...)
	}
	if spec.VolumeMode == nil && pick.VolumeMode != nil {
		mode := *pick.VolumeMode
		spec.VolumeMode = &mode
	}
}

// filesystemOverhead is the CDI CR's overhead for className.
func (c *Controller) filesystemOverhead(ctx context.Context, className string) float64 {
	cfg, err := c.virt.CDIConfig(ctx)
	if err != nil || cfg == nil || cfg.FilesystemOverhead == nil {
		return importstate.DefaultFilesystemOverhead
	}
	fo := cfg.FilesystemOverhead
	value := fo.Global
	if v, ok := fo.StorageClass[className]; ok {
		value = v
	}
	f, err := strconv.ParseFloat(string(value), 64)
	if err != nil || f < 0 || f >= 1 {
		return importstate.DefaultFilesystemOverhead
	}
	return f
}

// placeImmediately gives a pending claim a node when nothing will consume
// it soon (a WaitForFirstConsumer claim asked to bind at once, or a claim
// of an Immediate class of ours): a clone goes to its source's node, a
// snapshot restore to the node holding the snapshot, any other claim to
// the node the Placer picks among those that can take it (volumeFit, with
// the workload placement of what fills the volume: workload). A node the
// claim's class does not allow, or no node at all, is a claimError naming
// why.
func (c *Controller) placeImmediately(ctx context.Context, pvc *corev1.PersistentVolumeClaim, src *cdiv1.DataVolumeSource,
	workload func(context.Context, *storagev1.StorageClass) nodeplacement.Placement) error {
	sc := c.storageClass(deref(pvc.Spec.StorageClassName))
	node := ""
	if src != nil && src.Snapshot != nil {
		loc, err := c.snapshotSource(ctx, src)
		if err != nil {
			return err
		}
		if loc.Node == "" {
			return claimErrorf("SnapshotNotPlaced", "volumesnapshot %s/%s is on no known node", src.Snapshot.Namespace, src.Snapshot.Name)
		}
		node = loc.Node
	} else if src != nil && src.PVC != nil {
		n, err := c.claimNode(ctx, src.PVC.Namespace, src.PVC.Name)
		if err != nil {
			return err
		}
		node = n
	}
	if node != "" {
		// The copy is made where its source is: that node must be one
		// the class allows.
		if err := c.sourceNodeAllowed(ctx, sc, node); err != nil {
			return err
		}
	} else {
		fit := volumeFit(sc, workload(ctx, sc), sourceKind(src) == importstate.SourceUpload)
		n, why, err := c.pickNode(ctx, fit)
		if err != nil {
			return err
		}
		if n == "" {
			return claimErrorf("NoNodeAvailable", "no node can take pvc %s/%s: %s", pvc.Namespace, pvc.Name, why)
		}
		node = n
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{importstate.AnnSelectedNode: node}}})
	_, err := c.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return fmt.Errorf("select node %s for pvc %s/%s: %w", node, pvc.Namespace, pvc.Name, err)
	}
	c.log.Info("selected node for immediate binding", "namespace", pvc.Namespace, "pvc", pvc.Name, "node", node)
	return nil
}

// sourceNodeAllowed checks that sc's allowedTopologies include node, where
// a clone or restore must be made.
func (c *Controller) sourceNodeAllowed(ctx context.Context, sc *storagev1.StorageClass, node string) error {
	if nodeplacement.AllowedTopologies(sc) == nil {
		return nil
	}
	n, err := c.kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return claimErrorf("SourceNodeNotFound", "node %s holding the source: %w", node, err)
	}
	if !nodeplacement.TopologyAllows(sc, n) {
		return claimErrorf("NoNodeAvailable", "the source is on node %s, which is %s", node, nodeplacement.NotInTopologies(sc))
	}
	return nil
}

// pickNode asks the Placer for a node fit accepts; without one, the first
// such node by name. With no node, why says what kept each one out.
func (c *Controller) pickNode(ctx context.Context, fit func(*corev1.Node) string) (node, why string, err error) {
	if c.cfg.Placer != nil {
		node, why, ok := c.cfg.Placer.PlaceVolume(fit)
		if !ok {
			return "", "", claimErrorf("SchedulerNotReady", "the scheduler cannot place volumes yet")
		}
		return node, why, nil
	}
	nodes, err := c.kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return "", "", fmt.Errorf("list nodes: %w", err)
	}
	names, reasons := []string{}, map[string]int{}
	for _, n := range nodes.Items {
		if w := fit(&n); w != "" {
			reasons[w]++
			continue
		}
		names = append(names, n.Name)
	}
	if len(names) == 0 {
		return "", nodeplacement.FitMessage(len(nodes.Items), reasons, ""), nil
	}
	return slices.Min(names), "", nil
}

// claimNode is the node holding the volume of a claim: its PV's hostpath
// topology, or its selected node.
func (c *Controller) claimNode(ctx context.Context, ns, name string) (string, error) {
	pvc, err := c.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", claimErrorf("CloneSourceNotFound", "clone source pvc %s/%s: %w", ns, name, err)
	}
	if pvc.Spec.VolumeName != "" {
		pv, err := c.kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err == nil {
			if n := importstate.PVNode(pv); n != "" {
				return n, nil
			}
		}
	}
	if n := pvc.Annotations[importstate.AnnSelectedNode]; n != "" {
		return n, nil
	}
	return "", claimErrorf("CloneSourceNotPlaced", "clone source pvc %s/%s is on no node yet", ns, name)
}

// workloadPlacement is the CDI CR's spec.workload (what HCO's
// spec.workloads.nodePlacement renders there): where CDI runs its importer
// and upload pods, which fill a DataVolume's volume. Without a CDI CR it
// asks nothing.
func (c *Controller) workloadPlacement(ctx context.Context, _ *storagev1.StorageClass) nodeplacement.Placement {
	p := nodeplacement.Placement{Field: "cdi spec.workload"}
	if cdi, err := c.virt.CDI(ctx); err == nil && cdi != nil {
		w := cdi.Spec.Workloads
		p.NodeSelector, p.Affinity, p.Tolerations = w.NodeSelector, w.Affinity, w.Tolerations
	}
	return p
}

// volumeFit says why a node cannot receive a volume placed at once ("" when
// it can): it must be Ready, not cordoned nor going away, have an upload
// endpoint for an upload, be among sc's allowedTopologies (read as the CSI
// external-provisioner reads them: node labels, kubernetes.io/hostname
// included), and be one CDI's workload placement admits: its node selector
// and required affinity, and a NoSchedule or NoExecute taint only when its
// tolerations tolerate it, as for CDI's importer and upload pods, which
// tolerate nothing else (PreferNoSchedule only lowers the node's score).
func volumeFit(sc *storagev1.StorageClass, workload nodeplacement.Placement, needUpload bool) func(*corev1.Node) string {
	return func(n *corev1.Node) string {
		switch {
		case n.DeletionTimestamp != nil:
			return "being deleted"
		case n.Spec.Unschedulable:
			return "cordoned"
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady && cond.Status != corev1.ConditionTrue {
				return "not ready"
			}
		}
		if needUpload && n.Annotations[importstate.NodeUploadEndpoint] == "" {
			return "no upload endpoint"
		}
		if !nodeplacement.TopologyAllows(sc, n) {
			return nodeplacement.NotInTopologies(sc)
		}
		return nodeplacement.Admits(workload, n)
	}
}

var errNotOwned = errors.New("a pvc of this name exists and is not owned by the datavolume")
