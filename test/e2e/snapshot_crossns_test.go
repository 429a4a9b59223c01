package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
)

// TestCrossNamespaceSnapshotRestoreFollowsCDIsRule: a user may restore a
// VolumeSnapshot of another namespace into a DataVolume only with "create"
// on datavolumes/source (cdi.kubevirt.io) there. Refused at admission
// without it; with it the node restores the snapshot's bytes, taking the
// source from the brain's request, never from the claim.
func TestCrossNamespaceSnapshotRestoreFollowsCDIsRule(t *testing.T) {
	e := require(t)
	dst := e.namespace(t)
	ctx := context.Background()

	src, data := dst.goldenNamespace("-snap")
	snaps := snapshotv1.NewClient(dynamic.NewForConfigOrDie(e.rest))
	claim, class := "golden", "hostpath-csi-snapclass"
	if _, err := snaps.Snapshots.Create(ctx, &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: src.name, Name: "golden-snap"},
		Spec: snapshotv1.VolumeSnapshotSpec{VolumeSnapshotClassName: &class,
			Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim}}}); err != nil {
		t.Fatal(err)
	}
	src.eventually(time.Minute, "volumesnapshot golden-snap ready", func() (bool, string) {
		vs, err := snaps.Snapshots.Get(ctx, src.name, "golden-snap")
		if err != nil || vs.Status == nil {
			return false, fmt.Sprint(err)
		}
		return vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse, fmt.Sprintf("status %+v", *vs.Status)
	})

	user := "restore-user-" + e.run
	dst.grant(dst.name, user, "dv-author",
		rbacv1.PolicyRule{APIGroups: []string{"cdi.kubevirt.io"}, Resources: []string{"datavolumes"}, Verbs: []string{"get", "list", "create"}})
	as := dst.userVirt(user)
	restore := immediateDV(dst.name, "restored", &cdiv1.DataVolumeSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Namespace: src.name, Name: "golden-snap"}})

	_, err := as.DataVolumes.Create(ctx, restore)
	want := fmt.Sprintf("insufficient permissions in clone source namespace %s", src.name)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("unauthorized cross-namespace restore: %v, want %q", err, want)
	}

	dst.grant(src.name, user, "restore-source",
		rbacv1.PolicyRule{APIGroups: []string{"cdi.kubevirt.io"}, Resources: []string{"datavolumes/source"}, Verbs: []string{"create"}})
	dst.eventually(30*time.Second, "authorized restore admitted", func() (bool, string) {
		_, err = as.DataVolumes.Create(ctx, restore)
		return err == nil, fmt.Sprint(err)
	})
	dst.waitImported("", "restored")
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(dst.name).Get(ctx, "restored", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pvc.Spec.DataSource != nil || pvc.Spec.DataSourceRef != nil {
		t.Errorf("restored claim names a source %+v %+v; the brain's request should", pvc.Spec.DataSource, pvc.Spec.DataSourceRef)
	}
	pv, err := e.kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil || pv.Spec.CSI == nil {
		t.Fatalf("pv %q of the restored claim: %v", pvc.Spec.VolumeName, err)
	}
	disk := e.path("pools", poolName(), "volumes", pv.Spec.CSI.VolumeHandle, "disk.img")
	got, err := os.ReadFile(disk)
	if err != nil {
		t.Fatalf("the restored volume's disk: %v", err)
	}
	if len(got) < len(data) || !bytes.Equal(got[:len(data)], data) {
		t.Fatalf("%s (%d bytes) does not start with the snapshot's %d bytes", disk, len(got), len(data))
	}
}
