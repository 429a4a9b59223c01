package scheduler

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	kubevirtv1 "kubevirt.io/api/core/v1"

	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// snapshotEnv is a WaitForFirstConsumer storage class and VolumeSnapshots
// kept by node snap-b, as the node's snapshotter reports them.
type snapshotEnv struct {
	env
	snaps  *snapshotv1.Client
	scName string
}

func newSnapshotEnv(t *testing.T, e env) snapshotEnv {
	t.Helper()
	ctx := context.Background()
	e.node("snap-a", nodeSpec{cpu: "4", mem: "4Gi"})
	e.node("snap-b", nodeSpec{cpu: "4", mem: "4Gi"})
	se := snapshotEnv{env: e, snaps: snapshotv1.NewClient(dynamic.NewForConfigOrDie(controlplane.Shared(t).RestConfig)), scName: e.ns + "-snap"}
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: se.scName}, Provisioner: "kubevirt.io.hostpath-provisioner", VolumeBindingMode: &wffc}
	if _, err := e.kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.kube.StorageV1().StorageClasses().Delete(ctx, se.scName, metav1.DeleteOptions{}) })
	return se
}

// snapshot makes the VolumeSnapshot name, kept by snap-b.
func (se snapshotEnv) snapshot(name string, ready bool) {
	t, ctx := se.t, context.Background()
	t.Helper()
	content := se.ns + "-" + name
	yes, handle, size := ready, "snap-"+name, int64(1<<30)
	claim := "src"
	vs, err := se.snaps.Snapshots.Create(ctx, &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: se.ns, Name: name},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim}}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := se.snaps.Contents.Create(ctx, &snapshotv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: content, Annotations: map[string]string{snapshotv1.AnnNode: "snap-b"}},
		Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: "kubevirt.io.hostpath-provisioner", DeletionPolicy: snapshotv1.DeletionPolicy("Delete"),
			VolumeSnapshotRef: corev1.ObjectReference{Namespace: se.ns, Name: name, UID: vs.UID},
			Source:            snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &handle}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = se.snaps.Contents.Delete(context.Background(), "", content) })
	c.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &handle, ReadyToUse: &yes, RestoreSize: &size}
	if _, err := se.snaps.Contents.UpdateStatus(ctx, c); err != nil {
		t.Fatal(err)
	}
	q := resource.NewQuantity(size, resource.BinarySI)
	vs.Status = &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: &content, ReadyToUse: &yes, RestoreSize: q}
	if _, err := se.snaps.Snapshots.UpdateStatus(ctx, vs); err != nil {
		t.Fatal(err)
	}
}

// restore makes the unbound claim restoring snapshot snap.
func (se snapshotEnv) restore(claim, snap string) {
	se.t.Helper()
	group := snapshotv1.GroupName
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: se.ns, Name: claim}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		StorageClassName: &se.scName,
		DataSource:       &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: snap}}}
	if _, err := se.kube.CoreV1().PersistentVolumeClaims(se.ns).Create(context.Background(), pvc, metav1.CreateOptions{}); err != nil {
		se.t.Fatal(err)
	}
}

func onClaim(claim string) func(*kubevirtv1.VirtualMachineInstance) {
	return func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Volumes = []kubevirtv1.Volume{{Name: "d", VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}}
	}
}

// TestSnapshotRestoreLocality: a VMI whose unbound WaitForFirstConsumer
// claim restores a VolumeSnapshot lands on the node keeping the snapshot
// (only there can the claim be provisioned), and the claim is given that
// node; a snapshot not ready yet leaves the VMI waiting with the reason.
func TestSnapshotRestoreLocality(t *testing.T) {
	e := newSnapshotEnv(t, setup(t))
	ctx := context.Background()

	e.snapshot("golden", true)
	e.restore("restored", "golden")
	for _, name := range []string{"from-snap-1", "from-snap-2"} {
		e.vmi(name, "1Gi", onClaim("restored"))
		e.wantNode(name, "snap-b")
	}
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(ctx, "restored", metav1.GetOptions{})
	if err != nil || pvc.Annotations[SelectedNodeAnno] != "snap-b" {
		t.Errorf("restored claim not given the snapshot's node: %v %v", err, pvc.Annotations)
	}

	e.snapshot("pending", false)
	e.restore("early", "pending")
	e.vmi("too-early", "1Gi", onClaim("early"))
	_, msg := e.outcome("too-early")
	if !strings.Contains(msg, "volumesnapshot pending is not ready to restore yet") {
		t.Errorf("unschedulable message %q: want the snapshot's readiness", msg)
	}
}

// slowLocator holds every Locate (an API read) until release is closed.
type slowLocator struct {
	SnapshotLocator
	entered, release chan struct{}
	once             sync.Once
}

func (l *slowLocator) Locate(ctx context.Context, ns, name string) (snapshotv1.Location, error) {
	l.once.Do(func() { close(l.entered) })
	select {
	case <-l.release:
	case <-ctx.Done():
	}
	return l.SnapshotLocator.Locate(ctx, ns, name)
}

// TestNoAPICallUnderTheDecisionLock: while the API read locating a VMI's
// snapshot is slow, other decisions (a reservation for a VMI the VM
// controller is about to create) still go ahead: the read is made before
// the scheduler takes its decision lock.
func TestNoAPICallUnderTheDecisionLock(t *testing.T) {
	slow := &slowLocator{entered: make(chan struct{}), release: make(chan struct{})}
	var release sync.Once
	free := func() { release.Do(func() { close(slow.release) }) }
	defer free()
	e := newSnapshotEnv(t, setupWith(t, func(c *Config) {
		slow.SnapshotLocator = c.Snapshots
		c.Snapshots = slow
	}))
	e.snapshot("golden", true)
	e.restore("restored", "golden")
	e.vmi("from-snap", "1Gi", onClaim("restored"))
	select {
	case <-slow.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the scheduler never located the snapshot")
	}

	reserved := make(chan string, 1)
	go func() {
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "other"}}
		v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}
		reserved <- e.sched.Reserve(v)
	}()
	select {
	case node := <-reserved:
		if node == "" {
			t.Error("no node reserved for a VMI that fits anywhere")
		}
	case <-time.After(5 * time.Second):
		t.Error("a reservation waited for another VMI's snapshot lookup: an API call is made under the decision lock")
	}
	free()
	e.wantNode("from-snap", "snap-b")
}
