package scheduler

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	kubevirtv1 "kubevirt.io/api/core/v1"

	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// TestSnapshotRestoreLocality: a VMI whose unbound WaitForFirstConsumer
// claim restores a VolumeSnapshot lands on the node keeping the snapshot
// (only there can the claim be provisioned), and the claim is given that
// node; a snapshot not ready yet leaves the VMI waiting with the reason.
func TestSnapshotRestoreLocality(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	e.node("snap-a", nodeSpec{cpu: "4", mem: "4Gi"})
	e.node("snap-b", nodeSpec{cpu: "4", mem: "4Gi"})
	snaps := snapshotv1.NewClient(dynamic.NewForConfigOrDie(controlplane.Shared(t).RestConfig))

	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	scName := e.ns + "-snap"
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: scName}, Provisioner: "kubevirt.io.hostpath-provisioner", VolumeBindingMode: &wffc}
	if _, err := e.kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.kube.StorageV1().StorageClasses().Delete(ctx, scName, metav1.DeleteOptions{}) })

	// A snapshot kept by snap-b, as the node's snapshotter reports it.
	snapshot := func(name string, ready bool) {
		t.Helper()
		content := e.ns + "-" + name
		yes, handle, size := ready, "snap-"+name, int64(1<<30)
		claim := "src"
		vs, err := snaps.Snapshots.Create(ctx, &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
			Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim}}})
		if err != nil {
			t.Fatal(err)
		}
		c, err := snaps.Contents.Create(ctx, &snapshotv1.VolumeSnapshotContent{
			ObjectMeta: metav1.ObjectMeta{Name: content, Annotations: map[string]string{snapshotv1.AnnNode: "snap-b"}},
			Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: "kubevirt.io.hostpath-provisioner", DeletionPolicy: snapshotv1.DeletionPolicy("Delete"),
				VolumeSnapshotRef: corev1.ObjectReference{Namespace: e.ns, Name: name, UID: vs.UID},
				Source:            snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &handle}}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = snaps.Contents.Delete(context.Background(), "", content) })
		c.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &handle, ReadyToUse: &yes, RestoreSize: &size}
		if _, err := snaps.Contents.UpdateStatus(ctx, c); err != nil {
			t.Fatal(err)
		}
		q := resource.NewQuantity(size, resource.BinarySI)
		vs.Status = &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: &content, ReadyToUse: &yes, RestoreSize: q}
		if _, err := snaps.Snapshots.UpdateStatus(ctx, vs); err != nil {
			t.Fatal(err)
		}
	}
	restore := func(claim, snap string) {
		t.Helper()
		group := snapshotv1.GroupName
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: claim}, Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			StorageClassName: &scName,
			DataSource:       &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: snap}}}
		if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	onClaim := func(claim string) func(*kubevirtv1.VirtualMachineInstance) {
		return func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Volumes = []kubevirtv1.Volume{{Name: "d", VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}}
		}
	}

	snapshot("golden", true)
	restore("restored", "golden")
	for _, name := range []string{"from-snap-1", "from-snap-2"} {
		e.vmi(name, "1Gi", onClaim("restored"))
		e.wantNode(name, "snap-b")
	}
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(ctx, "restored", metav1.GetOptions{})
	if err != nil || pvc.Annotations[SelectedNodeAnno] != "snap-b" {
		t.Errorf("restored claim not given the snapshot's node: %v %v", err, pvc.Annotations)
	}

	snapshot("pending", false)
	restore("early", "pending")
	e.vmi("too-early", "1Gi", onClaim("early"))
	_, msg := e.outcome("too-early")
	if !strings.Contains(msg, "volumesnapshot pending is not ready to restore yet") {
		t.Errorf("unschedulable message %q: want the snapshot's readiness", msg)
	}
}
