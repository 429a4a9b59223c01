package datavolume

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/nodeagent/provisioner"
	"github.com/nodevirt/nodevirt/nodeagent/snapshotter"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// snapNode runs real node roles in the snapshot test; it has no Node object,
// so the other tests' placement never picks it.
const snapNode = "snap-node"

// startSnapNode runs a real CSI driver on a temporary pool with the
// provisioner, snapshotter and importer roles of snapNode.
func startSnapNode(t *testing.T, e env) *hostpath.Driver {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("needs root: volumes are loop-mounted images")
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	root := t.TempDir()
	d, err := hostpath.New(hostpath.Config{NodeID: snapNode, StateRoot: root, Endpoint: filepath.Join(root, "csi.sock"),
		Pools: []hostpath.PoolConfig{{Name: "default", Path: filepath.Join(root, "default")}}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	p, err := provisioner.New(provisioner.Config{NodeName: snapNode, Client: e.kube, Driver: d, Snapshots: e.snaps,
		Reads: nodereads.Direct{Core: e.kube, BrainNamespace: brainNamespace}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	s, err := snapshotter.New(snapshotter.Config{NodeName: snapNode, Kube: e.kube, Snapshots: e.snaps, Driver: d, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	imp, err := dvimport.New(dvimport.Config{NodeName: snapNode, Kube: e.kube, Virt: e.virt, Resolver: dvimport.CSIResolver(d), Log: log})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 3)
	for _, run := range []func(context.Context) error{p.Run, s.Run, imp.Run} {
		go func() { done <- run(ctx) }()
	}
	t.Cleanup(func() {
		cancel()
		for range 3 {
			<-done
		}
		bg := context.Background()
		if snaps, err := d.ListSnapshots(bg, &csispec.ListSnapshotsRequest{}); err == nil {
			for _, s := range snaps.GetEntries() {
				_, _ = d.DeleteSnapshot(bg, &csispec.DeleteSnapshotRequest{SnapshotId: s.GetSnapshot().GetSnapshotId()})
			}
		}
		if vols, err := d.ListVolumes(bg, &csispec.ListVolumesRequest{}); err == nil {
			for _, v := range vols.GetEntries() {
				if _, err := d.DeleteVolume(bg, &csispec.DeleteVolumeRequest{VolumeId: v.GetVolume().GetVolumeId()}); err != nil {
					t.Errorf("cleanup: %v", err)
				}
			}
		}
	})
	return d
}

// volumeDir is the directory of the volume bound to claim name.
func (e env) volumeDir(t *testing.T, d *hostpath.Driver, name string) string {
	t.Helper()
	pvc := e.waitPVC(t, name, func(p *corev1.PersistentVolumeClaim) bool { return p.Status.Phase == corev1.ClaimBound })
	pv, err := e.kube.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir, err := d.VolumePath(pv.Spec.CSI.VolumeHandle)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestDataVolumeFromSnapshot: a volume is written, snapshotted with the
// default class the controller made, and overwritten; DataVolumes with
// spec.source.snapshot and with a sourceRef to a DataSource of the snapshot
// are restored on the snapshot's node with the original bytes and succeed;
// one smaller than the snapshot fails with a readable reason; one naming a
// missing snapshot waits. From another namespace, a DataVolume whose
// creator was authorized (the admission stamp) is restored through the
// brain's request, its claim naming no source; one not authorized fails.
func TestDataVolumeFromSnapshot(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	d := startSnapNode(t, e)

	var vc *snapshotv1.VolumeSnapshotClass
	testkit.Until(t, 30*time.Second, "default volumesnapshotclass", func() bool {
		var err error
		vc, err = e.snaps.Classes.Get(ctx, "", HostpathSnapshotClass)
		return err == nil
	})
	if vc.Driver != hostpath.DriverName || vc.DeletionPolicy != snapshotv1.VolumeSnapshotContentDelete ||
		vc.Annotations[snapshotv1.AnnIsDefaultClass] != "true" {
		t.Errorf("default class %+v", vc)
	}

	class := e.ns + "-hostpath"
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	if _, err := e.kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: class}, Provisioner: hostpath.DriverName, VolumeBindingMode: &wffc,
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.kube.StorageV1().StorageClasses().Delete(ctx, class, metav1.DeleteOptions{}) })

	src := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "src", Annotations: map[string]string{importstate.AnnSelectedNode: snapNode}},
		Spec: corev1.PersistentVolumeClaimSpec{StorageClassName: &class,
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("16Mi")}}},
	}
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(ctx, src, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	srcDir := e.volumeDir(t, d, "src")
	original := bytes.Repeat([]byte("golden image "), 1000)
	if err := os.WriteFile(filepath.Join(srcDir, "disk.img"), original, 0o644); err != nil {
		t.Fatal(err)
	}
	pvcName := "src"
	if _, err := e.snaps.Snapshots.Create(ctx, &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "golden"},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &pvcName}}}); err != nil {
		t.Fatal(err)
	}
	testkit.Until(t, 30*time.Second, "snapshot ready", func() bool {
		vs, err := e.snaps.Snapshots.Get(ctx, e.ns, "golden")
		return err == nil && vs.Status != nil && vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse
	})
	if err := os.WriteFile(filepath.Join(srcDir, "disk.img"), []byte("overwritten"), 0o644); err != nil {
		t.Fatal(err)
	}

	immediate := map[string]string{importstate.AnnImmediateBinding: "true"}
	pvcDV := func(name, size string, src *cdiv1.DataVolumeSource) *cdiv1.DataVolume {
		return &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns, Annotations: immediate},
			Spec: cdiv1.DataVolumeSpec{Source: src, PVC: &corev1.PersistentVolumeClaimSpec{StorageClassName: &class,
				AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}}}}}
	}
	e.create(t, pvcDV("restored", "16Mi", &cdiv1.DataVolumeSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Name: "golden"}}))
	e.create(t, pvcDV("too-small", "8Mi", &cdiv1.DataVolumeSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Name: "golden"}}))
	e.create(t, pvcDV("missing", "16Mi", &cdiv1.DataVolumeSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Name: "nope"}}))
	e.create(t, pvcDV("hostile", "16Mi", &cdiv1.DataVolumeSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Name: "../../golden"}}))
	ds := &cdiv1.DataSource{ObjectMeta: metav1.ObjectMeta{Name: "golden-ds", Namespace: e.ns},
		Spec: cdiv1.DataSourceSpec{Source: cdiv1.DataSourceSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Name: "golden"}}}}
	if _, err := e.virt.DataSources.Create(ctx, ds); err != nil {
		t.Fatal(err)
	}
	// spec.storage without a size takes the snapshot's.
	byRef := &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Name: "by-ref", Namespace: e.ns, Annotations: immediate},
		Spec: cdiv1.DataVolumeSpec{SourceRef: &cdiv1.DataVolumeSourceRef{Kind: cdiv1.DataVolumeDataSource, Name: "golden-ds"},
			Storage: &cdiv1.StorageSpec{StorageClassName: &class}}}
	e.create(t, byRef)

	for _, name := range []string{"restored", "by-ref"} {
		dv := e.wait(t, name, "Succeeded", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Succeeded })
		if dv.Status.Progress != "100.0%" || dvimporttest.Condition(dv, cdiv1.DataVolumeReady).Status != corev1.ConditionTrue {
			t.Errorf("%s: status %+v", name, dv.Status)
		}
		pvc := e.waitPVC(t, name, func(*corev1.PersistentVolumeClaim) bool { return true })
		if pvc.Annotations[importstate.AnnSelectedNode] != snapNode {
			t.Errorf("%s placed on %q, want the snapshot's node", name, pvc.Annotations[importstate.AnnSelectedNode])
		}
		if got := pvc.Spec.Resources.Requests.Storage().Value(); got != 16<<20 {
			t.Errorf("%s requests %d bytes, want the snapshot's 16Mi", name, got)
		}
		got, err := os.ReadFile(filepath.Join(e.volumeDir(t, d, name), "disk.img"))
		if err != nil || !bytes.Equal(got, original) {
			t.Errorf("%s holds %d bytes (equal %v, err %v), want the snapshot's", name, len(got), bytes.Equal(got, original), err)
		}
	}
	events, err := e.kube.CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "restored").String()})
	if err != nil {
		t.Fatal(err)
	}
	var cloned bool
	for _, ev := range events.Items {
		cloned = cloned || ev.Reason == "CloneSucceeded"
	}
	if !cloned {
		t.Error("no CloneSucceeded event on the restored datavolume")
	}

	// From another namespace.
	other := e
	other.ns = controlplane.Shared(t).Namespace(t)
	across := pvcDV("across", "16Mi", &cdiv1.DataVolumeSource{Snapshot: &cdiv1.DataVolumeSourceSnapshot{Namespace: e.ns, Name: "golden"}})
	across.Namespace = other.ns
	unauthorized := across.DeepCopy()
	unauthorized.Name = "across-unauthorized"
	across.Annotations = map[string]string{importstate.AnnImmediateBinding: "true", AnnAuthorizedSource: kindSnapshotSource + "/" + e.ns + "/golden"}
	other.create(t, across)
	other.create(t, unauthorized)
	other.wait(t, "across", "Succeeded", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Succeeded })
	pvc := other.waitPVC(t, "across", func(*corev1.PersistentVolumeClaim) bool { return true })
	if pvc.Annotations[importstate.AnnSelectedNode] != snapNode || pvc.Spec.DataSource != nil || pvc.Spec.DataSourceRef != nil {
		t.Errorf("across: placed on %q with data source %+v / %+v, want the snapshot's node and none",
			pvc.Annotations[importstate.AnnSelectedNode], pvc.Spec.DataSource, pvc.Spec.DataSourceRef)
	}
	if got, err := os.ReadFile(filepath.Join(other.volumeDir(t, d, "across"), "disk.img")); err != nil || !bytes.Equal(got, original) {
		t.Errorf("across holds %d bytes (equal %v, err %v), want the snapshot's", len(got), bytes.Equal(got, original), err)
	}
	denied := other.wait(t, "across-unauthorized", "Failed", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Failed })
	if c := dvimporttest.Condition(denied, cdiv1.DataVolumeBound); c.Reason != "CloneNotAuthorized" {
		t.Errorf("across-unauthorized: bound condition %+v", c)
	}

	small := e.wait(t, "too-small", "Failed", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Failed })
	if c := dvimporttest.Condition(small, cdiv1.DataVolumeRunning); c.Reason != "SnapshotTooLarge" || !strings.Contains(c.Message, "smaller than the restore size 16Mi") {
		t.Errorf("too-small: running condition %+v", c)
	}
	hostile := e.wait(t, "hostile", "Failed", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Failed })
	if c := dvimporttest.Condition(hostile, cdiv1.DataVolumeBound); c.Reason != "InvalidSnapshotName" || !strings.Contains(c.Message, `"../../golden" is not valid`) {
		t.Errorf("hostile: bound condition %+v", c)
	}
	missing := e.wait(t, "missing", "pending on its snapshot", func(dv *cdiv1.DataVolume) bool {
		return dvimporttest.Condition(dv, cdiv1.DataVolumeBound).Reason == "SnapshotNotFound"
	})
	if missing.Status.Phase != cdiv1.Pending || !strings.Contains(dvimporttest.Condition(missing, cdiv1.DataVolumeBound).Message, "nope") {
		t.Errorf("missing: %+v", missing.Status)
	}
}
