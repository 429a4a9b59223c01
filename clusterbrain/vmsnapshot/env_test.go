package vmsnapshot

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	volsnapv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/provisioner"
	"github.com/nodevirt/nodevirt/nodeagent/snapshotter"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// Claims are bound by the real kube-controller-manager.
func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{ControllerManager: true})
}

// Env is the controller against the test control plane with a node's
// real storage roles: the hostpath CSI driver on a temporary pool, its
// provisioner and snapshotter. Guests do not run: a VMI is an object the
// test writes, and the guest's freeze is the recording Freezer below.
type Env struct {
	T       *testing.T
	Ctx     context.Context
	Kube    kubernetes.Interface
	Virt    *client.Set
	Snaps   *volsnapv1.Client
	Driver  *hostpath.Driver
	NS      string
	Class   string // StorageClass, WaitForFirstConsumer
	Freezer *RecordingFreezer
	Kubecfg string
	Node    string
}

// RecordingFreezer records freeze and thaw calls in order.
type RecordingFreezer struct {
	mu    sync.Mutex
	calls []string
	// OnFreeze, when set, runs at each freeze.
	OnFreeze func()
}

// Freeze implements Freezer.
func (f *RecordingFreezer) Freeze(_ context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	f.mu.Lock()
	f.calls = append(f.calls, "freeze "+vmi.Name)
	hook := f.OnFreeze
	f.mu.Unlock()
	if hook != nil {
		hook()
	}
	return nil
}

// Unfreeze implements Freezer.
func (f *RecordingFreezer) Unfreeze(_ context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "thaw "+vmi.Name)
	return nil
}

// Calls returns the calls so far.
func (f *RecordingFreezer) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func quiet() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// Start runs the storage roles and the controller for one test.
func Start(t *testing.T) *Env {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("needs root: volumes are loop-mounted images")
	}
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	testkit.InstallSnapshotCRDs(t, cp)
	ctx, cancel := context.WithCancel(context.Background())
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	e := &Env{T: t, Ctx: ctx, Kube: cp.Clientset(t), Virt: virt, NS: cp.Namespace(t),
		Snaps: volsnapv1.NewClient(dynamic.NewForConfigOrDie(cp.RestConfig)), Freezer: &RecordingFreezer{}}
	e.Node = "node-" + e.NS
	root := t.TempDir()
	d, err := hostpath.New(hostpath.Config{NodeID: e.Node, StateRoot: root, Endpoint: filepath.Join(root, "csi.sock"),
		Pools: []hostpath.PoolConfig{{Name: "fast", Path: filepath.Join(root, "fast")}}, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	e.Driver = d
	e.Class = e.NS + "-hostpath"
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	if _, err := e.Kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: e.Class}, Provisioner: hostpath.DriverName, VolumeBindingMode: &wffc,
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	class := &volsnapv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: "vmsnapshot-test-default",
		Annotations: map[string]string{volsnapv1.AnnIsDefaultClass: "true"}}, Driver: hostpath.DriverName, DeletionPolicy: volsnapv1.DeletionPolicy("Delete")}
	if _, err := e.Snaps.Classes.Create(ctx, class); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	p, err := provisioner.New(provisioner.Config{NodeName: e.Node, Client: e.Kube, Driver: d, Snapshots: e.Snaps, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	s, err := snapshotter.New(snapshotter.Config{NodeName: e.Node, Kube: e.Kube, Snapshots: e.Snaps, Driver: d, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	vms, vmis := virt.VMs.Informer("", 0, nil), virt.VMIs.Informer("", 0, nil)
	c, err := New(Config{Virt: virt, Kube: e.Kube, Snapshots: e.Snaps, VMs: vms, VMIs: vmis, Freezer: e.Freezer, Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{p.Run, s.Run, c.Run} {
		wg.Go(func() { _ = run(ctx) })
	}
	go vms.RunWithContext(ctx)
	go vmis.RunWithContext(ctx)
	t.Cleanup(func() {
		// Objects first (the roles release their finalizers), then the
		// roles, then the driver's volumes.
		_ = e.Kube.CoreV1().Namespaces().Delete(context.Background(), e.NS, metav1.DeleteOptions{})
		cancel()
		wg.Wait()
		cleanDriver(d)
		_ = e.Kube.StorageV1().StorageClasses().Delete(context.Background(), e.Class, metav1.DeleteOptions{})
	})
	e.Kubecfg = filepath.Join(t.TempDir(), "kubeconfig")
	if err := cp.WriteKubeconfig(e.Kubecfg, "vmsnapshot-admin", "system:masters"); err != nil {
		t.Fatal(err)
	}
	return e
}

func cleanDriver(d *hostpath.Driver) {
	ctx := context.Background()
	if snaps, err := d.ListSnapshots(ctx, &csispec.ListSnapshotsRequest{}); err == nil {
		for _, s := range snaps.GetEntries() {
			_, _ = d.DeleteSnapshot(ctx, &csispec.DeleteSnapshotRequest{SnapshotId: s.GetSnapshot().GetSnapshotId()})
		}
	}
	if vols, err := d.ListVolumes(ctx, &csispec.ListVolumesRequest{}); err == nil {
		for _, v := range vols.GetEntries() {
			_, _ = d.DeleteVolume(ctx, &csispec.DeleteVolumeRequest{VolumeId: v.GetVolume().GetVolumeId()})
		}
	}
}

// Claim creates a claim provisioned on the env's node at once.
func (e *Env) Claim(name string) {
	e.T.Helper()
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: name, Labels: map[string]string{"disk": name},
			Annotations: map[string]string{provisioner.AnnSelectedNode: e.Node}},
		Spec: corev1.PersistentVolumeClaimSpec{StorageClassName: &e.Class,
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("16Mi")}}},
	}
	if _, err := e.Kube.CoreV1().PersistentVolumeClaims(e.NS).Create(e.Ctx, pvc, metav1.CreateOptions{}); err != nil {
		e.T.Fatal(err)
	}
}

// Dir waits for the claim to bind and returns its volume's directory.
func (e *Env) Dir(name string) string {
	e.T.Helper()
	var pvc *corev1.PersistentVolumeClaim
	testkit.Poll(e.T, 2*time.Minute, "claim "+name+" bound", func() (bool, error) {
		var err error
		pvc, err = e.Kube.CoreV1().PersistentVolumeClaims(e.NS).Get(e.Ctx, name, metav1.GetOptions{})
		return err == nil && pvc.Status.Phase == corev1.ClaimBound, err
	})
	pv, err := e.Kube.CoreV1().PersistentVolumes().Get(e.Ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		e.T.Fatal(err)
	}
	dir, err := e.Driver.VolumePath(pv.Spec.CSI.VolumeHandle)
	if err != nil {
		e.T.Fatal(err)
	}
	return dir
}

// VM creates a stopped VM with a claim volume and a containerDisk.
func (e *Env) VM(name, claim string) *kubevirtv1.VirtualMachine {
	e.T.Helper()
	halted := kubevirtv1.RunStrategyHalted
	vm := &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: name, Labels: map[string]string{"app": name}},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &halted, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
			Spec: kubevirtv1.VirtualMachineInstanceSpec{
				Domain: kubevirtv1.DomainSpec{Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{Name: "disk"}, {Name: "boot"}}}},
				Volumes: []kubevirtv1.Volume{
					{Name: "disk", VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
						PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
					{Name: "boot", VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "example.org/boot:1"}}},
				}}}},
	}
	got, err := e.Virt.VMs.Create(e.Ctx, vm)
	if err != nil {
		e.T.Fatal(err)
	}
	return got
}

// RunningVMI writes a running VMI for vm, agent connected or not, as a
// node agent would.
func (e *Env) RunningVMI(vm string, agent bool) {
	e.T.Helper()
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: vm},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{}}}
	got, err := e.Virt.VMIs.Create(e.Ctx, vmi)
	if err != nil {
		e.T.Fatal(err)
	}
	got.Status.Phase, got.Status.NodeName = kubevirtv1.Running, e.Node
	if agent {
		got.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstanceAgentConnected, Status: corev1.ConditionTrue}}
	}
	if _, err := e.Virt.VMIs.UpdateStatus(e.Ctx, got); err != nil {
		e.T.Fatal(err)
	}
}

// Kubectl runs kubectl in the env's namespace.
func (e *Env) Kubectl(args ...string) string {
	e.T.Helper()
	bin, err := exec.LookPath("kubectl")
	if err != nil {
		e.T.Fatalf("kubectl is needed: %v", err)
	}
	out, err := exec.CommandContext(e.Ctx, bin, append([]string{"--kubeconfig", e.Kubecfg, "-n", e.NS}, args...)...).CombinedOutput()
	if err != nil {
		e.T.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}
