package datavolume

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
)

// HostpathSnapshotClass is the default VolumeSnapshotClass the brain
// creates for the hostpath CSI driver.
const HostpathSnapshotClass = "hostpath-csi-snapclass"

// ensureSnapshotClass creates hostpath-csi-snapclass if it is missing,
// default for the driver unless another class of the driver is. Without
// the snapshot API (no CRDs) it does nothing.
func (c *Controller) ensureSnapshotClass(ctx context.Context) error {
	classes := c.cfg.Snapshots.Classes
	_, err := classes.Get(ctx, "", HostpathSnapshotClass)
	if err == nil {
		return nil
	}
	if !apierrors.IsNotFound(err) && !meta.IsNoMatchError(err) {
		return fmt.Errorf("get volumesnapshotclass %s: %w", HostpathSnapshotClass, err)
	}
	existing, err := classes.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list volumesnapshotclasses: %w", err)
	}
	isDefault := "true"
	for _, vc := range existing {
		if vc.Driver == HostpathProvisioner && vc.Annotations[snapshotv1.AnnIsDefaultClass] == "true" {
			isDefault = "false"
		}
	}
	vc := &snapshotv1.VolumeSnapshotClass{
		ObjectMeta: metav1.ObjectMeta{Name: HostpathSnapshotClass,
			Annotations: map[string]string{snapshotv1.AnnIsDefaultClass: isDefault},
			Labels:      map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
		Driver:         HostpathProvisioner,
		DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete,
	}
	if _, err := classes.Create(ctx, vc); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create volumesnapshotclass %s: %w", HostpathSnapshotClass, err)
	}
	c.log.Info("created volumesnapshotclass", "volumesnapshotclass", HostpathSnapshotClass, "default", isDefault)
	return nil
}

// snapshotSource locates the VolumeSnapshot a DataVolume restores. A
// snapshot that does not exist, is not ready or is another driver's keeps
// the DataVolume pending.
func (c *Controller) snapshotSource(ctx context.Context, src *cdiv1.DataVolumeSource) (snapshotv1.Location, error) {
	ns, name := src.Snapshot.Namespace, src.Snapshot.Name
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return snapshotv1.Location{}, &claimError{reason: "InvalidSnapshotName", fatal: true,
			err: fmt.Errorf("volumesnapshot name %q is not valid: %s", name, strings.Join(errs, "; "))}
	}
	if c.cfg.Snapshots == nil {
		return snapshotv1.Location{}, claimErrorf("SnapshotUnavailable", "volumesnapshot %s/%s: the brain has no snapshot client", ns, name)
	}
	loc, err := c.cfg.Snapshots.Locate(ctx, ns, name)
	switch {
	case apierrors.IsNotFound(err):
		return loc, claimErrorf("SnapshotNotFound", "volumesnapshot %s/%s not found", ns, name)
	case err != nil && loc.Error != "":
		return loc, claimErrorf("SnapshotFailed", "%w", err)
	case err != nil:
		return loc, claimErrorf("SnapshotNotReady", "%w", err)
	case loc.Driver != HostpathProvisioner:
		return loc, &claimError{reason: "SnapshotUnsupported", fatal: true,
			err: fmt.Errorf("volumesnapshot %s/%s belongs to driver %s: only %s snapshots are restored", ns, name, loc.Driver, HostpathProvisioner)}
	case !loc.Ready:
		return loc, claimErrorf("SnapshotNotReady", "volumesnapshot %s/%s is not ready to use yet", ns, name)
	}
	return loc, nil
}

// snapshotDataSource points spec at the VolumeSnapshot name.
func snapshotDataSource(spec *corev1.PersistentVolumeClaimSpec, name string) {
	group := snapshotv1.GroupName
	spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: name}
	spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: name}
}
