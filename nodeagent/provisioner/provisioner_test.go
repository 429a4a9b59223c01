package provisioner

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// The claims are bound by the real kube-controller-manager.
func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{ControllerManager: true})
}

const node = "node-a"

// newDriver is a CSI driver on temporary pools; its volumes are deleted
// when the test ends.
func newDriver(t *testing.T) *hostpath.Driver {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("needs root: volumes are loop-mounted images")
	}
	root := t.TempDir()
	d, err := hostpath.New(hostpath.Config{
		NodeID:    node,
		StateRoot: root,
		Endpoint:  filepath.Join(root, "csi.sock"),
		Pools:     []hostpath.PoolConfig{{Name: "fast", Path: filepath.Join(root, "fast")}},
		Logger:    slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		list, err := d.ListVolumes(ctx, &csispec.ListVolumesRequest{})
		if err != nil {
			t.Error(err)
			return
		}
		for _, e := range list.GetEntries() {
			if _, err := d.DeleteVolume(ctx, &csispec.DeleteVolumeRequest{VolumeId: e.GetVolume().GetVolumeId()}); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
	})
	return d
}

func startProvisioner(t *testing.T, cs kubernetes.Interface, d *hostpath.Driver) {
	t.Helper()
	p, err := New(Config{NodeName: node, Client: cs, Driver: d,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("provisioner: %v", err)
		}
	})
}

func createClass(t *testing.T, cs kubernetes.Interface, name, provisioner string) {
	t.Helper()
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	sc := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: name},
		Provisioner:       provisioner,
		VolumeBindingMode: &wffc,
		Parameters:        map[string]string{hostpath.ParamStoragePool: "fast"},
	}
	if _, err := cs.StorageV1().StorageClasses().Create(context.Background(), sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.StorageV1().StorageClasses().Delete(context.Background(), name, metav1.DeleteOptions{}) })
}

func createClaim(t *testing.T, cs kubernetes.Interface, ns, name, class, size, selected string, block bool) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Annotations: map[string]string{AnnSelectedNode: selected}},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &class,
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: resource.MustParse(size),
			}},
		},
	}
	if block {
		m := corev1.PersistentVolumeBlock
		pvc.Spec.VolumeMode = &m
	}
	out, err := cs.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), pvc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func waitBound(t *testing.T, cs kubernetes.Interface, ns, name string) (*corev1.PersistentVolumeClaim, *corev1.PersistentVolume) {
	t.Helper()
	var pvc *corev1.PersistentVolumeClaim
	testkit.Poll(t, time.Minute, "claim "+name+" bound", func() (bool, error) {
		var err error
		pvc, err = cs.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && pvc.Status.Phase == corev1.ClaimBound, err
	})
	pv, err := cs.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc, pv
}

// TestProvisionsThisNodesClaims: claims of the CSI and legacy classes
// selected for this node get a volume of the requested size and a PV the
// controller-manager binds; a claim for another node is left alone; a
// released volume is deleted with its PV.
func TestProvisionsThisNodesClaims(t *testing.T) {
	cp := controlplane.Shared(t)
	cs := cp.Clientset(t)
	ns := cp.Namespace(t)
	d := newDriver(t)
	csiClass, legacyClass := ns+"-csi", ns+"-legacy"
	createClass(t, cs, csiClass, CSIProvisionerName)
	createClass(t, cs, legacyClass, LegacyProvisionerName)
	startProvisioner(t, cs, d)

	other := createClaim(t, cs, ns, "other-node", csiClass, "16Mi", "node-b", false)
	createClaim(t, cs, ns, "disk", csiClass, "24Mi", node, false)
	createClaim(t, cs, ns, "raw", csiClass, "8Mi", node, true)
	createClaim(t, cs, ns, "legacy", legacyClass, "16Mi", node, false)

	pvc, pv := waitBound(t, cs, ns, "disk")
	if got := pv.Spec.Capacity[corev1.ResourceStorage]; got.Value() != 24<<20 {
		t.Errorf("PV capacity %s, want the requested 24Mi", got.String())
	}
	if got := pvc.Status.Capacity[corev1.ResourceStorage]; got.Value() != 24<<20 {
		t.Errorf("claim capacity %s, want 24Mi", got.String())
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != hostpath.DriverName || pinnedNode(pv) != node {
		t.Fatalf("PV source %+v affinity %+v", pv.Spec.CSI, pv.Spec.NodeAffinity)
	}
	dir, err := d.VolumePath(pv.Spec.CSI.VolumeHandle)
	if err != nil {
		t.Fatal(err)
	}
	if err := fill(filepath.Join(dir, "big"), 32<<20); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("writing 32Mi into the 24Mi claim: got %v, want ENOSPC", err)
	}

	_, rawPV := waitBound(t, cs, ns, "raw")
	disk, isBlock, err := d.VolumeDisk(rawPV.Spec.CSI.VolumeHandle)
	if err != nil || !isBlock || rawPV.Spec.CSI.FSType != "" {
		t.Errorf("block claim: disk %s block %v err %v fstype %q", disk, isBlock, err, rawPV.Spec.CSI.FSType)
	}

	_, legacyPV := waitBound(t, cs, ns, "legacy")
	if legacyPV.Spec.HostPath == nil {
		t.Fatalf("legacy PV source %+v", legacyPV.Spec.PersistentVolumeSource)
	}
	if st, err := os.Stat(legacyPV.Spec.HostPath.Path); err != nil || !st.IsDir() {
		t.Errorf("legacy hostPath %s: %v", legacyPV.Spec.HostPath.Path, err)
	}

	// The other node's claim was seen (it was created first) but not taken.
	o, err := cs.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), other.Name, metav1.GetOptions{})
	if err != nil || o.Spec.VolumeName != "" || o.Status.Phase != corev1.ClaimPending {
		t.Errorf("claim for node-b: %v %+v", err, o.Status)
	}
	if _, err := cs.CoreV1().PersistentVolumes().Get(context.Background(), volumeName(other), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("a PV was made for node-b's claim: %v", err)
	}

	events, err := cs.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "disk").String(),
	})
	if err != nil {
		t.Fatal(err)
	}
	var succeeded bool
	for _, e := range events.Items {
		succeeded = succeeded || e.Reason == reasonProvisioned
	}
	if !succeeded {
		t.Errorf("no %s event on the claim (events: %d)", reasonProvisioned, len(events.Items))
	}

	// Releasing: the claim goes, the volume and its PV follow.
	if err := cs.CoreV1().PersistentVolumeClaims(ns).Delete(context.Background(), "disk", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "released PV deleted", func() (bool, error) {
		_, err := cs.CoreV1().PersistentVolumes().Get(context.Background(), pv.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), err
	})
	if _, err := d.VolumePath(pv.Spec.CSI.VolumeHandle); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("volume of the released claim still exists: %v", err)
	}
}

// TestRetainKeepsTheVolume: with reclaim policy Retain a released volume
// and its PV stay.
func TestRetainKeepsTheVolume(t *testing.T) {
	cp := controlplane.Shared(t)
	cs := cp.Clientset(t)
	ns := cp.Namespace(t)
	d := newDriver(t)
	retain := corev1.PersistentVolumeReclaimRetain
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	class := ns + "-retain"
	_, err := cs.StorageV1().StorageClasses().Create(context.Background(), &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: class}, Provisioner: CSIProvisionerName,
		ReclaimPolicy: &retain, VolumeBindingMode: &wffc,
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.StorageV1().StorageClasses().Delete(context.Background(), class, metav1.DeleteOptions{})
	})
	startProvisioner(t, cs, d)

	createClaim(t, cs, ns, "keep", class, "16Mi", node, false)
	_, pv := waitBound(t, cs, ns, "keep")
	if err := cs.CoreV1().PersistentVolumeClaims(ns).Delete(context.Background(), "keep", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "PV released", func() (bool, error) {
		got, err := cs.CoreV1().PersistentVolumes().Get(context.Background(), pv.Name, metav1.GetOptions{})
		return err == nil && got.Status.Phase == corev1.VolumeReleased, err
	})
	time.Sleep(500 * time.Millisecond) // give a wrong deletion the chance to happen
	if _, err := d.VolumePath(pv.Spec.CSI.VolumeHandle); err != nil {
		t.Errorf("retained volume is gone: %v", err)
	}
	// Deleting the PV object releases our finalizer but keeps the data.
	if err := cs.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "retained PV object removed", func() (bool, error) {
		_, err := cs.CoreV1().PersistentVolumes().Get(context.Background(), pv.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), err
	})
	if _, err := d.VolumePath(pv.Spec.CSI.VolumeHandle); err != nil {
		t.Errorf("retained volume deleted with its PV object: %v", err)
	}
}

func fill(path string, n int) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := bytes.Repeat([]byte{7}, 1<<20)
	for i := 0; i < n; i += len(buf) {
		if _, err := f.Write(buf); err != nil {
			return err
		}
	}
	return f.Sync()
}

// TestClaimsOfAnAddedPool: a pool the driver starts serving while it runs
// (a HostPathProvisioner's, package storagepools) takes the claims of a
// class naming it.
func TestClaimsOfAnAddedPool(t *testing.T) {
	cp := controlplane.Shared(t)
	cs := cp.Clientset(t)
	ns := cp.Namespace(t)
	d := newDriver(t)
	startProvisioner(t, cs, d)
	dir := filepath.Join(t.TempDir(), "added", "csi")
	if err := d.AddPool(hostpath.PoolConfig{Name: "added", Path: dir}); err != nil {
		t.Fatal(err)
	}
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	class := ns + "-added"
	if _, err := cs.StorageV1().StorageClasses().Create(context.Background(), &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: class}, Provisioner: CSIProvisionerName, VolumeBindingMode: &wffc,
		Parameters: map[string]string{hostpath.ParamStoragePool: "added"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cs.StorageV1().StorageClasses().Delete(context.Background(), class, metav1.DeleteOptions{})
	})
	createClaim(t, cs, ns, "in-added", class, "16Mi", node, false)
	_, pv := waitBound(t, cs, ns, "in-added")
	if _, err := os.Stat(filepath.Join(dir, "volumes", pv.Spec.CSI.VolumeHandle+".img")); err != nil {
		t.Fatalf("claim's volume not in the added pool: %v", err)
	}
}
