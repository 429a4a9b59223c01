// Package migstate is the protocol between the brain and the two node
// agents of a live migration. Its one shared object is the
// VirtualMachineInstanceMigration's status (the status subresource, which
// users cannot write); each daemon owns some keys of
// status.migrationState and writes only those:
//
//   - the brain: status.phase and phaseTransitionTimestamps, and in
//     migrationState: migrationUid, sourceNode, targetNode, abortRequested,
//     migrationConfiguration. It picks the target (the scheduler, never the
//     source node, addedNodeSelector honoured), and when the source
//     reports the end it moves the VMI (kubevirt.io/nodeName label and
//     status.nodeName) to the target and copies migrationState onto the
//     VMI.
//   - the target node: targetNodeAddress (its InternalIP) and
//     targetNodeDomainReadyTimestamp once it has made what the guest needs
//     there (taps on the same bridges with the same MACs, disks, the
//     domain defined but not started); failed and failureReason when it
//     cannot. After a failure it removes what it made.
//   - the source node: startTimestamp and mode when it starts the libvirt
//     peer-to-peer migration to the target's libvirtd, then endTimestamp,
//     completed, failed, failureReason and abortStatus.
//
// The phases follow from the keys: Pending (new), Scheduling, Scheduled
// (target chosen), PreparingTarget, TargetReady (targetNodeAddress),
// Running (startTimestamp), Succeeded or Failed (completed). Deleting a
// migration that has not ended sets abortRequested; the source aborts the
// libvirt job and reports abortStatus; the brain's finalizer keeps the
// object until then.
//
// Node-local disks (claims bound to a PersistentVolume pinned to the source
// node) move with the guest: the target node creates a volume for each with
// its own CSI driver before the copy (libvirt's NBD storage copy); after
// success it creates a PersistentVolume named TargetVolumeName, pinned to
// itself and pre-bound to the claim's namespace and name. The brain then
// replaces the claim by one of the same name, labels, annotations and
// owner (the DataVolume), bound to that volume, marking the DataVolume with
// AnnClaimMoving meanwhile so that its controller does not make a new empty
// claim; the released source volume is deleted by the source node's
// provisioner (reclaim policy Delete). A failed migration leaves the claims
// alone and the target node deletes the volumes it made.
//
// A node agent's writes are narrowed by the node restriction (package
// rbac): only migrations whose sourceNode or targetNode is that node, and
// never those two keys.
package migstate

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
)

// Finalizer keeps a migration until its outcome is settled (KubeVirt's
// name).
const Finalizer = "kubevirt.io/migrationJobFinalize"

// AnnClaimMoving on a DataVolume says its claim is being replaced by one
// bound to another node's volume (value: the migration's UID): the
// DataVolume controller does not recreate the claim meanwhile.
const AnnClaimMoving = "nodevirt.io/claim-moving"

// TargetVolumeName is the PersistentVolume the target node makes for the
// volume (the VMI's volume name) of migration migUID.
func TargetVolumeName(migUID types.UID, volume string) string {
	return "mig-" + string(migUID) + "-" + volume
}

// Final reports whether the migration has ended.
func Final(m *kubevirtv1.VirtualMachineInstanceMigration) bool {
	return m.Status.Phase == kubevirtv1.MigrationSucceeded || m.Status.Phase == kubevirtv1.MigrationFailed
}

// Ended reports whether the source (or a failing target) has reported the
// end of the migration.
func Ended(s *kubevirtv1.VirtualMachineInstanceMigrationState) bool {
	return s != nil && (s.Completed || s.Failed)
}

// UpdateState applies change to the migration's migrationState (made when
// missing) on a fresh copy, retrying on conflicts; change returns false when
// there is nothing to write. A migration that is gone is no error.
func UpdateState(ctx context.Context, virt *client.Set, namespace, name string,
	change func(*kubevirtv1.VirtualMachineInstanceMigration, *kubevirtv1.VirtualMachineInstanceMigrationState) bool) error {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := virt.Migrations.Get(ctx, namespace, name)
		if err != nil {
			return err
		}
		out := cur.DeepCopy()
		if out.Status.MigrationState == nil {
			out.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{MigrationUID: out.UID}
		}
		if !change(out, out.Status.MigrationState) {
			return nil
		}
		_, err = virt.Migrations.UpdateStatus(ctx, out)
		return err
	})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("migration %s/%s status: %w", namespace, name, err)
	}
	return nil
}
