package snapshotter

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/crds"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/provisioner"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// Claims are bound by the real kube-controller-manager.
func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{ControllerManager: true})
}

const node = "snap-node"

type env struct {
	kube   kubernetes.Interface
	snaps  *snapshotv1.Client
	driver *hostpath.Driver
	pool   string
	ns     string
	class  string // StorageClass
	log    *slog.Logger
	logs   *logBuffer
}

// logBuffer keeps the roles' log lines to look for refused calls.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func quiet() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// setup starts a real CSI driver on a temporary pool, the provisioner and
// the snapshotter of node, against the shared control plane with the
// snapshot CRDs installed.
func setup(t *testing.T) env {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("needs root: volumes are loop-mounted images")
	}
	cp := controlplane.Shared(t)
	ctx := context.Background()
	testkit.InstallSnapshotCRDs(t, cp)
	e := env{kube: cp.Clientset(t), snaps: snapshotv1.NewClient(dynamic.NewForConfigOrDie(cp.RestConfig)), ns: cp.Namespace(t),
		logs: &logBuffer{}}
	e.log = slog.New(slog.NewTextHandler(io.MultiWriter(os.Stderr, e.logs), &slog.HandlerOptions{Level: slog.LevelInfo}))
	root := t.TempDir()
	e.pool = filepath.Join(root, "fast")
	d, err := hostpath.New(hostpath.Config{NodeID: node, StateRoot: root, Endpoint: filepath.Join(root, "csi.sock"),
		Pools: []hostpath.PoolConfig{{Name: "fast", Path: e.pool}}, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	e.driver = d
	t.Cleanup(func() { cleanDriver(t, d) })

	e.class = e.ns + "-hostpath"
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	if _, err := e.kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: e.class}, Provisioner: hostpath.DriverName, VolumeBindingMode: &wffc,
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.kube.StorageV1().StorageClasses().Delete(ctx, e.class, metav1.DeleteOptions{}) })

	// The roles run as the nodeagent does: system:node:<node> under the
	// nodeagent's least-privilege role.
	if err := rbac.EnsureDaemons(ctx, e.kube); err != nil {
		t.Fatal(err)
	}
	kc := filepath.Join(root, "node.kubeconfig")
	if err := cp.WriteKubeconfig(kc, identity.NodeUser(node), identity.NodesGroup); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	nodeKube := kubernetes.NewForConfigOrDie(rc)
	nodeSnaps := snapshotv1.NewClient(dynamic.NewForConfigOrDie(rc))
	p, err := provisioner.New(provisioner.Config{NodeName: node, Client: nodeKube, Driver: d, Snapshots: nodeSnaps, Logger: e.log})
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{NodeName: node, Kube: nodeKube, Snapshots: nodeSnaps, Driver: d, Logger: e.log})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 2)
	go func() { done <- p.Run(runCtx) }()
	go func() { done <- s.Run(runCtx) }()
	t.Cleanup(func() {
		cancel()
		for range 2 {
			if err := <-done; err != nil {
				t.Errorf("role: %v", err)
			}
		}
		if l := e.logs.String(); strings.Contains(strings.ToLower(l), "forbidden") {
			t.Errorf("a call of the roles was forbidden under the nodeagent's role:\n%s", l)
		}
	})
	return e
}

func cleanDriver(t *testing.T, d *hostpath.Driver) {
	ctx := context.Background()
	snaps, err := d.ListSnapshots(ctx, &csispec.ListSnapshotsRequest{})
	if err == nil {
		for _, s := range snaps.GetEntries() {
			_, _ = d.DeleteSnapshot(ctx, &csispec.DeleteSnapshotRequest{SnapshotId: s.GetSnapshot().GetSnapshotId()})
		}
	}
	vols, err := d.ListVolumes(ctx, &csispec.ListVolumesRequest{})
	if err != nil {
		t.Error(err)
		return
	}
	for _, v := range vols.GetEntries() {
		if _, err := d.DeleteVolume(ctx, &csispec.DeleteVolumeRequest{VolumeId: v.GetVolume().GetVolumeId()}); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	}
}

func (e env) snapshotClass(t *testing.T, policy snapshotv1.DeletionPolicy) string {
	t.Helper()
	name := e.ns + "-" + strings.ToLower(string(policy))
	c := &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Driver: hostpath.DriverName, DeletionPolicy: policy}
	if _, err := e.snaps.Classes.Create(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.snaps.Classes.Delete(context.Background(), "", name) })
	return name
}

func (e env) claim(t *testing.T, name, size, fromSnapshot string) {
	t.Helper()
	e.claimOn(t, name, size, fromSnapshot, node)
}

// startOtherNode runs a second node's driver and provisioner (as admin).
func (e env) startOtherNode(t *testing.T, name string) {
	t.Helper()
	root := t.TempDir()
	d, err := hostpath.New(hostpath.Config{NodeID: name, StateRoot: root, Endpoint: filepath.Join(root, "csi.sock"),
		Pools: []hostpath.PoolConfig{{Name: "fast", Path: filepath.Join(root, "fast")}}, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cleanDriver(t, d) })
	p, err := provisioner.New(provisioner.Config{NodeName: name, Client: e.kube, Driver: d, Snapshots: e.snaps, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("provisioner of %s: %v", name, err)
		}
	})
}

func (e env) claimMode(t *testing.T, name, fromSnapshot string, mode *corev1.PersistentVolumeMode) {
	t.Helper()
	e.claimWith(t, name, "8Mi", fromSnapshot, node, mode)
}

func (e env) claimOn(t *testing.T, name, size, fromSnapshot, selected string) {
	t.Helper()
	e.claimWith(t, name, size, fromSnapshot, selected, nil)
}

func (e env) claimWith(t *testing.T, name, size, fromSnapshot, selected string, mode *corev1.PersistentVolumeMode) {
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Annotations: map[string]string{provisioner.AnnSelectedNode: selected}},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &e.class,
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	pvc.Spec.VolumeMode = mode
	if fromSnapshot != "" {
		group := snapshotv1.GroupName
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: fromSnapshot}
		pvc.Spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: fromSnapshot}
	}
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(context.Background(), pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// boundDir waits for the claim to bind and returns its volume directory.
func (e env) boundDir(t *testing.T, name string, block ...bool) (dir, volumeID string) {
	t.Helper()
	var pvc *corev1.PersistentVolumeClaim
	testkit.Poll(t, time.Minute, "claim "+name+" bound", func() (bool, error) {
		var err error
		pvc, err = e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && pvc.Status.Phase == corev1.ClaimBound, err
	})
	pv, err := e.kube.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(block) > 0 && block[0] {
		return "", pv.Spec.CSI.VolumeHandle
	}
	dir, err = e.driver.VolumePath(pv.Spec.CSI.VolumeHandle)
	if err != nil {
		t.Fatal(err)
	}
	return dir, pv.Spec.CSI.VolumeHandle
}

func (e env) snapshot(t *testing.T, name string, src snapshotv1.VolumeSnapshotSource, class string) {
	t.Helper()
	vs := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: src}}
	if class != "" {
		vs.Spec.VolumeSnapshotClassName = &class
	}
	if _, err := e.snaps.Snapshots.Create(context.Background(), vs); err != nil {
		t.Fatal(err)
	}
}

func (e env) waitSnapshot(t *testing.T, name, what string, ok func(*snapshotv1.VolumeSnapshot) bool) *snapshotv1.VolumeSnapshot {
	t.Helper()
	var vs *snapshotv1.VolumeSnapshot
	testkit.Poll(t, time.Minute, "volumesnapshot "+name+" "+what, func() (bool, error) {
		var err error
		vs, err = e.snaps.Snapshots.Get(context.Background(), e.ns, name)
		return err == nil && ok(vs), err
	})
	return vs
}

func ready(vs *snapshotv1.VolumeSnapshot) bool {
	return vs.Status != nil && vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse
}

func errorMessage(vs *snapshotv1.VolumeSnapshot) string {
	if vs.Status == nil || vs.Status.Error == nil || vs.Status.Error.Message == nil {
		return ""
	}
	return *vs.Status.Error.Message
}

func ptr[T any](v T) *T { return &v }

// TestSnapshotRestoreAndDelete: bytes written into a volume, snapshot
// taken, source overwritten; a claim restored from the snapshot holds the
// original bytes, a claim smaller than the snapshot is refused with a
// readable event, and deleting the snapshot removes its content and the
// CSI snapshot's image.
func TestSnapshotRestoreAndDelete(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	class := e.snapshotClass(t, snapshotv1.VolumeSnapshotContentDelete)
	e.claim(t, "src", "16Mi", "")
	srcDir, srcID := e.boundDir(t, "src")
	original := bytes.Repeat([]byte("original"), 4096)
	if err := os.WriteFile(filepath.Join(srcDir, "data"), original, 0o644); err != nil {
		t.Fatal(err)
	}

	e.snapshot(t, "snap", snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr("src")}, class)
	vs := e.waitSnapshot(t, "snap", "ready", ready)
	if vs.Status.RestoreSize == nil || vs.Status.RestoreSize.Value() != 16<<20 {
		t.Errorf("restoreSize %v, want 16Mi", vs.Status.RestoreSize)
	}
	if vs.Status.CreationTime == nil || time.Since(vs.Status.CreationTime.Time) > time.Minute {
		t.Errorf("creationTime %v", vs.Status.CreationTime)
	}
	contentName := *vs.Status.BoundVolumeSnapshotContentName
	content, err := e.snaps.Contents.Get(ctx, "", contentName)
	if err != nil {
		t.Fatal(err)
	}
	if content.Spec.DeletionPolicy != snapshotv1.VolumeSnapshotContentDelete || content.Annotations[snapshotv1.AnnNode] != node ||
		*content.Spec.Source.VolumeHandle != srcID || content.Spec.VolumeSnapshotRef.UID != vs.UID {
		t.Errorf("content spec %+v annotations %v", content.Spec, content.Annotations)
	}
	handle := *content.Status.SnapshotHandle
	image := filepath.Join(e.pool, "snapshots", handle+".img")
	if _, err := os.Stat(image); err != nil {
		t.Fatalf("snapshot image: %v", err)
	}

	if err := os.WriteFile(filepath.Join(srcDir, "data"), bytes.Repeat([]byte("CHANGED!"), 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	e.claim(t, "restored", "16Mi", "snap")
	e.claim(t, "too-small", "8Mi", "snap")
	e.claim(t, "hostile", "16Mi", "../../snap")
	e.claimOn(t, "elsewhere", "16Mi", "snap", "snap-node-b")
	e.startOtherNode(t, "snap-node-b")
	dir, _ := e.boundDir(t, "restored")
	got, err := os.ReadFile(filepath.Join(dir, "data"))
	if err != nil || !bytes.Equal(got, original) {
		t.Fatalf("restored data: %d bytes, equal %v, err %v", len(got), bytes.Equal(got, original), err)
	}

	for claim, want := range map[string]string{
		"too-small": "requested size 8388608 bytes is smaller than the restore size 16777216 bytes",
		"hostile":   `volumesnapshot name "../../snap" is not valid`,
		"elsewhere": `is held by node "snap-node", the claim is selected for node snap-node-b`,
	} {
		testkit.Poll(t, time.Minute, "refusal event on "+claim, func() (bool, error) {
			events, err := e.kube.CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{
				FieldSelector: fields.OneTermEqualSelector("involvedObject.name", claim).String()})
			if err != nil {
				return false, err
			}
			for _, ev := range events.Items {
				if ev.Reason == "ProvisioningFailed" && strings.Contains(ev.Message, want) {
					return true, nil
				}
			}
			return false, nil
		})
		pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(ctx, claim, metav1.GetOptions{})
		if err != nil || pvc.Status.Phase != corev1.ClaimPending {
			t.Errorf("%s claim: %v %s", claim, err, pvc.Status.Phase)
		}
	}

	if err := e.snaps.Snapshots.Delete(ctx, e.ns, "snap"); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "snapshot and content gone", func() (bool, error) {
		_, err1 := e.snaps.Snapshots.Get(ctx, e.ns, "snap")
		_, err2 := e.snaps.Contents.Get(ctx, "", contentName)
		return apierrors.IsNotFound(err1) && apierrors.IsNotFound(err2), errors.Join(err1, err2)
	})
	if _, err := os.Stat(image); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("snapshot image still there: %v", err)
	}
	if _, err := e.driver.GetSnapshot(ctx, &csispec.GetSnapshotRequest{SnapshotId: handle}); status.Code(err) != codes.NotFound {
		t.Errorf("driver still knows snapshot %s: %v", handle, err)
	}
	// The restored volume is independent of the snapshot.
	if got, err := os.ReadFile(filepath.Join(dir, "data")); err != nil || !bytes.Equal(got, original) {
		t.Errorf("restored data changed after the snapshot went: %v", err)
	}
}

// TestRetainPreProvisionedAndErrors: a Retain snapshot survives its
// VolumeSnapshot and is adopted again through a pre-provisioned content;
// hostile handles and missing classes show as readable status errors.
func TestRetainPreProvisionedAndErrors(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	class := e.snapshotClass(t, snapshotv1.VolumeSnapshotContentRetain)
	e.claim(t, "src", "8Mi", "")
	srcDir, _ := e.boundDir(t, "src")
	if err := os.WriteFile(filepath.Join(srcDir, "data"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}

	e.snapshot(t, "no-class", snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr("src")}, "nope")
	vs := e.waitSnapshot(t, "no-class", "in error", func(vs *snapshotv1.VolumeSnapshot) bool { return errorMessage(vs) != "" })
	if msg := errorMessage(vs); !strings.Contains(msg, `volumesnapshotclass "nope" not found`) {
		t.Errorf("error %q", msg)
	}

	e.snapshot(t, "kept", snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr("src")}, class)
	vs = e.waitSnapshot(t, "kept", "ready", ready)
	contentName := *vs.Status.BoundVolumeSnapshotContentName
	content, err := e.snaps.Contents.Get(ctx, "", contentName)
	if err != nil {
		t.Fatal(err)
	}
	handle := *content.Status.SnapshotHandle
	if err := e.snaps.Snapshots.Delete(ctx, e.ns, "kept"); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "snapshot gone", func() (bool, error) {
		_, err := e.snaps.Snapshots.Get(ctx, e.ns, "kept")
		return apierrors.IsNotFound(err), err
	})
	time.Sleep(300 * time.Millisecond) // a wrong deletion would happen now
	if _, err := e.driver.GetSnapshot(ctx, &csispec.GetSnapshotRequest{SnapshotId: handle}); err != nil {
		t.Fatalf("retained snapshot deleted: %v", err)
	}
	if err := e.snaps.Contents.Delete(ctx, "", contentName); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "retained content object removed", func() (bool, error) {
		_, err := e.snaps.Contents.Get(ctx, "", contentName)
		return apierrors.IsNotFound(err), err
	})
	if _, err := e.driver.GetSnapshot(ctx, &csispec.GetSnapshotRequest{SnapshotId: handle}); err != nil {
		t.Fatalf("retained snapshot deleted with its content object: %v", err)
	}

	// Pre-provisioned: a content naming the kept snapshot, and one naming
	// a hostile handle.
	for name, h := range map[string]string{e.ns + "-adopt": handle, e.ns + "-hostile": "../../../etc/passwd"} {
		c := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: snapshotv1.VolumeSnapshotContentSpec{
				VolumeSnapshotRef: corev1.ObjectReference{Namespace: e.ns, Name: strings.TrimPrefix(name, e.ns+"-")},
				DeletionPolicy:    snapshotv1.VolumeSnapshotContentDelete, Driver: hostpath.DriverName,
				Source: snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: ptr(h)}}}
		if _, err := e.snaps.Contents.Create(ctx, c); err != nil {
			t.Fatal(err)
		}
		e.snapshot(t, strings.TrimPrefix(name, e.ns+"-"), snapshotv1.VolumeSnapshotSource{VolumeSnapshotContentName: ptr(name)}, "")
	}
	vs = e.waitSnapshot(t, "hostile", "in error", func(vs *snapshotv1.VolumeSnapshot) bool { return errorMessage(vs) != "" })
	if msg := errorMessage(vs); !strings.Contains(msg, "InvalidArgument") && !strings.Contains(msg, "invalid") {
		t.Errorf("hostile handle error %q", msg)
	}
	if ready(vs) {
		t.Error("hostile snapshot is ready")
	}
	vs = e.waitSnapshot(t, "adopt", "ready", ready)
	if vs.Status.RestoreSize == nil || vs.Status.RestoreSize.Value() != 8<<20 {
		t.Errorf("adopted restoreSize %v", vs.Status.RestoreSize)
	}
	e.claim(t, "from-adopted", "8Mi", "adopt")
	dir, _ := e.boundDir(t, "from-adopted")
	if got, err := os.ReadFile(filepath.Join(dir, "data")); err != nil || string(got) != "kept" {
		t.Errorf("restored from the adopted snapshot: %q %v", got, err)
	}
	// Its content's policy is Delete: deleting the snapshot deletes the data.
	if err := e.snaps.Snapshots.Delete(ctx, e.ns, "adopt"); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "adopted snapshot deleted in the driver", func() (bool, error) {
		_, err := e.driver.GetSnapshot(ctx, &csispec.GetSnapshotRequest{SnapshotId: handle})
		return status.Code(err) == codes.NotFound, err
	})
	// The hostile one goes without a node's help (no finalizer was added).
	if err := e.snaps.Snapshots.Delete(ctx, e.ns, "hostile"); err != nil {
		t.Fatal(err)
	}
	_ = e.snaps.Contents.Delete(ctx, "", e.ns+"-hostile")
	_ = e.snaps.Snapshots.Delete(ctx, e.ns, "no-class")
}

// TestSnapshotCRDsAreNotReplaced: InstallAbsent leaves a snapshot CRD that
// exists alone (a cluster's external-snapshotter owns it), where Install
// would apply nodevirt's over it.
func TestSnapshotCRDsAreNotReplaced(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	ext := apiextensionsclient.NewForConfigOrDie(cp.RestConfig)
	if err := crds.InstallAbsent(ctx, ext, crds.SnapshotCatalog()); err != nil {
		t.Fatal(err)
	}
	name := "volumesnapshotclasses." + snapshotv1.GroupName
	crd, err := ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Play the other installer: its CRD has other labels.
	crd.Labels = map[string]string{"app.kubernetes.io/part-of": "external-snapshotter"}
	if _, err := ext.ApiextensionsV1().CustomResourceDefinitions().Update(ctx, crd, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := crds.InstallAbsent(ctx, ext, crds.SnapshotCatalog()); err != nil {
		t.Fatal(err)
	}
	crd, err = ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if crd.Labels["app.kubernetes.io/managed-by"] == "nodevirt" || crd.Labels["app.kubernetes.io/part-of"] != "external-snapshotter" {
		t.Errorf("existing crd was re-applied: labels %v", crd.Labels)
	}
	if crd.Annotations["api-approved.kubernetes.io"] == "" {
		t.Error("crd of a protected group without its approval annotation")
	}
}

// TestBlockSnapshotRestore: a block volume's bytes survive a snapshot and
// a restore into a block claim.
func TestBlockSnapshotRestore(t *testing.T) {
	e := setup(t)
	class := e.snapshotClass(t, snapshotv1.VolumeSnapshotContentDelete)
	block := corev1.PersistentVolumeBlock
	e.claimMode(t, "raw", "", &block)
	_, rawID := e.boundDir(t, "raw", true)
	disk, isBlock, err := e.driver.VolumeDisk(rawID)
	if err != nil || !isBlock {
		t.Fatalf("block volume disk %s block %v: %v", disk, isBlock, err)
	}
	pattern := bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 1<<18) // 1 MiB
	writeAt(t, disk, pattern)
	e.snapshot(t, "raw-snap", snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr("raw")}, class)
	e.waitSnapshot(t, "raw-snap", "ready", ready)
	writeAt(t, disk, bytes.Repeat([]byte{0}, len(pattern)))

	e.claimMode(t, "raw-restored", "raw-snap", &block)
	_, id := e.boundDir(t, "raw-restored", true)
	restored, _, err := e.driver.VolumeDisk(id)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(restored)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, len(pattern))
	if _, err := io.ReadFull(f, got); err != nil || !bytes.Equal(got, pattern) {
		t.Errorf("restored block volume: equal %v, err %v", bytes.Equal(got, pattern), err)
	}
}

func writeAt(t *testing.T, path string, data []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}
