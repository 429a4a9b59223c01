package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
)

// TestVMFromSnapshot: a golden disk imported once is snapshotted with a
// VolumeSnapshot of the default hostpath class, and a VM whose
// dataVolumeTemplate restores that snapshot (CDI's `source.snapshot`,
// WaitForFirstConsumer) boots from the restored disk.
func TestVMFromSnapshot(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()

	golden := n.dataVolumeVM("golden", n.guestImageURL(), kubevirtv1.RunStrategyHalted).Spec.DataVolumeTemplates[0]
	dv := &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Namespace: n.name, Name: "golden",
		Annotations: map[string]string{"cdi.kubevirt.io/storage.bind.immediate.requested": "true"}}, Spec: golden.Spec}
	if _, err := e.virt.DataVolumes.Create(ctx, dv); err != nil {
		t.Fatal(err)
	}
	n.waitImported("golden", "golden")

	snaps := snapshotv1.NewClient(dynamic.NewForConfigOrDie(e.rest))
	claim, class := "golden", "hostpath-csi-snapclass"
	if _, err := snaps.Snapshots.Create(ctx, &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: n.name, Name: "golden-snap"},
		Spec: snapshotv1.VolumeSnapshotSpec{VolumeSnapshotClassName: &class,
			Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim}}}); err != nil {
		t.Fatal(err)
	}
	n.eventually(time.Minute, "volumesnapshot golden-snap ready", func() (bool, string) {
		vs, err := snaps.Snapshots.Get(ctx, n.name, "golden-snap")
		if err != nil {
			return false, err.Error()
		}
		if vs.Status == nil {
			return false, "no status"
		}
		return vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse, fmt.Sprintf("status %+v", *vs.Status)
	})

	vm := n.dataVolumeVM("restored", "unused", kubevirtv1.RunStrategyAlways)
	vm.Spec.DataVolumeTemplates[0].Spec.Source = &cdiv1.DataVolumeSource{
		Snapshot: &cdiv1.DataVolumeSourceSnapshot{Namespace: n.name, Name: "golden-snap"}}
	n.createVM(vm)
	n.waitImported("restored", "restored-root")
	n.waitVMIOfVM("restored", 2*time.Minute)
	s := n.waitBooted("restored")
	if !s.contains(`NODEVIRT-DISK vda \d+`) {
		t.Errorf("the guest booted from the restored disk but did not report vda")
	}
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(ctx, "restored-root", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ds := pvc.Spec.DataSourceRef; pvc.Spec.DataSource == nil && (ds == nil || ds.Kind != "VolumeSnapshot") {
		t.Errorf("restored claim's data source %+v %+v, want the VolumeSnapshot", pvc.Spec.DataSource, ds)
	}
}
