// Package dvimporttest has what tests of DataVolumes need around a real
// API server where no kubelet, CSI sidecars or provisioner run: Node
// objects, a provisioner that makes node-local CSI PVs for claims whose node
// is selected, a resolver mapping volume handles to directories, and test
// images.
package dvimporttest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// DirResolver keeps each volume in Root/<handle>/disk.img.
type DirResolver struct{ Root string }

// VolumeDisk implements dvimport.VolumeResolver.
func (r DirResolver) VolumeDisk(handle string) (string, bool, int64, error) {
	dir := filepath.Join(r.Root, filepath.Base(handle))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", false, 0, err
	}
	return filepath.Join(dir, "disk.img"), false, 0, nil
}

// Disk is the disk file of the volume bound to a claim.
func (r DirResolver) Disk(pvc *corev1.PersistentVolumeClaim) string {
	return filepath.Join(r.Root, "pvc-"+string(pvc.UID), "disk.img")
}

// CreateNode creates a Node object (no kubelet: just the API object),
// Ready, and keeps its Lease renewed for as long as the test binary runs,
// so that the node lifecycle controller never finds it unreachable and
// taints it (a tainted node takes no immediately placed claim).
func CreateNode(t testing.TB, kube kubernetes.Interface, name string) {
	t.Helper()
	ctx := context.Background()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{importstate.HostpathTopologyKey: name}}}
	_, err := kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	// The node lifecycle controller may taint the new node in between.
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		cur.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
			Reason: "KubeletReady", LastHeartbeatTime: now, LastTransitionTime: now}}
		_, err = kube.CoreV1().Nodes().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	go renewLease(kube, name)
}

// renewLease keeps node's Lease in kube-node-lease fresh, as a kubelet
// does, until the process ends.
func renewLease(kube kubernetes.Interface, node string) {
	ctx := context.Background()
	leases := kube.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	holder, seconds := node, int32(40)
	for ; ; time.Sleep(5 * time.Second) {
		now := metav1.NewMicroTime(time.Now())
		lease, err := leases.Get(ctx, node, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, _ = leases.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: node},
				Spec: coordinationv1.LeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: &seconds, RenewTime: &now}}, metav1.CreateOptions{})
			continue
		}
		if err != nil {
			continue
		}
		lease.Spec.RenewTime = &now
		_, _ = leases.Update(ctx, lease, metav1.UpdateOptions{})
	}
}

// Provision acts as the node's provisioner until ctx ends: every claim of
// namespace whose selected node is node gets a CSI PV pre-bound to it, with
// the handle "pvc-<claim uid>" and node affinity to node; the
// controller-manager binds them.
func Provision(ctx context.Context, t testing.TB, kube kubernetes.Interface, namespace, node string) {
	go func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			list, err := kube.CoreV1().PersistentVolumeClaims(namespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				continue
			}
			for _, pvc := range list.Items {
				if pvc.Spec.VolumeName != "" || pvc.Annotations[importstate.AnnSelectedNode] != node || pvc.DeletionTimestamp != nil {
					continue
				}
				pv := PV(&pvc, node)
				if _, err := kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) && ctx.Err() == nil {
					t.Logf("provision %s/%s: %v", pvc.Namespace, pvc.Name, err)
					continue
				}
				// Naming the volume on the claim makes the controller-manager
				// bind at once instead of at its next periodic claim sync.
				patch := fmt.Sprintf(`{"spec":{"volumeName":%q}}`, pv.Name)
				_, _ = kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
			}
		}
	}()
}

// PV is the node-local CSI volume the provisioner makes for pvc.
func PV(pvc *corev1.PersistentVolumeClaim, node string) *corev1.PersistentVolume {
	class := ""
	if pvc.Spec.StorageClassName != nil {
		class = *pvc.Spec.StorageClassName
	}
	return &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-" + string(pvc.UID)},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: pvc.Spec.Resources.Requests[corev1.ResourceStorage]},
			AccessModes:                   pvc.Spec.AccessModes,
			VolumeMode:                    pvc.Spec.VolumeMode,
			StorageClassName:              class,
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: "kubevirt.io.hostpath-provisioner", VolumeHandle: "pvc-" + string(pvc.UID)}},
			NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: importstate.HostpathTopologyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{node}}},
			}}}},
		},
	}
}

// MakeImage writes a raw disk image of size bytes with random data in a
// few places and zeros elsewhere, and returns its path.
func MakeImage(t testing.TB, dir, name string, size int64, seed int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	rnd := rand.New(rand.NewSource(seed))
	for _, off := range []int64{0, size / 3, size/2 + 4097, size - 256<<10} {
		b := make([]byte, 256<<10)
		rnd.Read(b)
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// SHA256 is the hex digest of a file.
func SHA256(t testing.TB, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// SameDisk fails t unless disk starts with image's bytes and holds only
// zeros after them (the import grows the disk to the volume).
func SameDisk(t testing.TB, disk, image string) {
	t.Helper()
	want, err := os.ReadFile(image)
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(disk)
	if err != nil {
		t.Fatalf("read disk: %v", err)
	}
	if len(got) < len(want) {
		t.Fatalf("disk %s has %d bytes, image %d", disk, len(got), len(want))
	}
	if sha256.Sum256(got[:len(want)]) != sha256.Sum256(want) {
		t.Fatalf("disk %s does not hold the image", disk)
	}
	if !bytes.Equal(got[len(want):], make([]byte, len(got)-len(want))) {
		t.Fatalf("disk %s has data past the image", disk)
	}
}

// DataVolumeGetter reads DataVolumes (client.Set.DataVolumes).
type DataVolumeGetter interface {
	Get(ctx context.Context, ns, name string) (*cdiv1.DataVolume, error)
}

// WaitDV polls a DataVolume until ok holds, failing t after timeout.
func WaitDV(t testing.TB, dvs DataVolumeGetter, ns, name string, timeout time.Duration, what string, ok func(*cdiv1.DataVolume) bool) *cdiv1.DataVolume {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var dv *cdiv1.DataVolume
	var err error
	for time.Now().Before(deadline) {
		if dv, err = dvs.Get(context.Background(), ns, name); err == nil && ok(dv) {
			return dv
		}
		time.Sleep(50 * time.Millisecond)
	}
	if dv != nil {
		t.Fatalf("datavolume %s: %s not reached in %s: phase %s progress %s restarts %d conditions %+v",
			name, what, timeout, dv.Status.Phase, dv.Status.Progress, dv.Status.RestartCount, dv.Status.Conditions)
	}
	t.Fatalf("datavolume %s: %v", name, err)
	return nil
}

// Condition returns the DataVolume's condition of type typ (zero if none).
func Condition(dv *cdiv1.DataVolume, typ cdiv1.DataVolumeConditionType) cdiv1.DataVolumeCondition {
	for _, c := range dv.Status.Conditions {
		if c.Type == typ {
			return c
		}
	}
	return cdiv1.DataVolumeCondition{}
}
