package handler

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	k8sv1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

var crdsOnce sync.Once

// node is one test's node: a control plane namespace, a private node name,
// a state directory QEMU can reach, a CSI driver, an mTLS PKI and a bridge
// name of its own.
type node struct {
	t        *testing.T
	name     string
	ns       string
	kube     kubernetes.Interface
	virt     *client.Set
	uri      string
	stateDir string
	netState string
	bridge   string
	pki      *console.PKI
	csi      *csi.Driver
	csiRoot  string
	lv       *launcher.Manager
	// pod is the pod network handlers of this node get (none when nil).
	pod    PodNetwork
	podErr error
	// hostDiskRoot is the handlers' host disk root (the default when "").
	hostDiskRoot string
}

// reachableDir makes a directory the qemu user can traverse, removed at the
// end of the test.
func reachableDir(t *testing.T, prefix string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func newNode(t *testing.T) *node {
	t.Helper()
	cp := controlplane.Shared(t)
	crdsOnce.Do(func() {
		testkit.InstallCRDs(t, cp)
	})
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	n := &node{
		t:      t,
		name:   fmt.Sprintf("node-%05d", rand.IntN(100000)),
		ns:     cp.Namespace(t),
		kube:   cp.Clientset(t),
		virt:   virt,
		uri:    libvirttest.Ensure(t),
		bridge: fmt.Sprintf("nvhb%05d", rand.IntN(100000)),
	}
	n.stateDir = reachableDir(t, "nodevirt-handler-")
	n.netState = t.TempDir()
	t.Cleanup(func() { exec.Command("ip", "link", "del", n.bridge).Run() })
	if n.pki, err = console.MintPKI(t.TempDir(), "127.0.0.1", n.name); err != nil {
		t.Fatal(err)
	}
	n.csiRoot = reachableDir(t, "nodevirt-handler-csi-")
	// The pool's volumes directory becomes a shared mount, as the node
	// agent has it: detached before the directory goes.
	testkit.UnmountBelowAtCleanup(t, n.csiRoot)
	n.csi, err = csi.New(csi.Config{NodeID: n.name, StateRoot: n.csiRoot, Endpoint: n.csiRoot + "/csi.sock",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), SharePools: true})
	if err != nil {
		t.Fatal(err)
	}
	if n.lv, err = launcher.Open(launcher.Config{URI: n.uri}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.lv.Close() })
	return n
}

// handler runs a handler for the node until stop is called or the test
// ends.
func (n *node) handler(emulation bool) (h *Handler, stop func()) {
	t := n.t
	t.Helper()
	h, err := New(Config{
		NodeName: n.name, StateDir: n.stateDir, LibvirtURI: n.uri, Emulation: emulation,
		Kube: n.kube, Virt: n.virt, Volumes: n.csi, NetStateDir: n.netState, ShutdownRetry: 2 * time.Second,
		PodNetwork: n.pod, PodNetworkErr: n.podErr, HostDiskRoot: n.hostDiskRoot,
		Console: n.pki.ServerConfig("127.0.0.1:0"),
		Log:     slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo})).With("node", n.name),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	select {
	case <-h.Ready():
	case err := <-done:
		t.Fatalf("handler stopped: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("handler not ready within 30s")
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("handler run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return h, stop
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

func (n *node) consoleClient(h *Handler) *console.Client {
	n.t.Helper()
	tc, err := n.pki.ClientTLS()
	if err != nil {
		n.t.Fatal(err)
	}
	return &console.Client{Addr: h.ConsoleAddr(), TLS: tc}
}

// bootVolume makes a CSI volume holding a copy of the test guest's boot
// disk, and a PV and a bound PVC named claim for it. It returns the disk's
// size.
func (n *node) bootVolume(ctx context.Context, claim string) int64 {
	n.t.Helper()
	return n.bootVolumeOf(ctx, claim, guest.DiskSpec{})
}

// bootVolumeOf is bootVolume with the boot disk of spec.
func (n *node) bootVolumeOf(ctx context.Context, claim string, spec guest.DiskSpec) int64 {
	t := n.t
	t.Helper()
	boot, err := guest.BootDisk(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	size := int64(128 << 20)
	resp, err := n.csi.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name:          n.ns + "-" + claim,
		CapacityRange: &csipb.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csipb.VolumeCapability{{
			AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}},
			AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}},
	})
	if err != nil {
		t.Fatalf("create csi volume: %v", err)
	}
	id := resp.GetVolume().GetVolumeId()
	t.Cleanup(func() { n.csi.DeleteVolume(context.Background(), &csipb.DeleteVolumeRequest{VolumeId: id}) })
	disk, _, err := n.csi.VolumeDisk(id)
	if err != nil {
		t.Fatal(err)
	}
	// The CSI driver makes its directories 0750; QEMU (another user) must
	// traverse them to reach disk.img. Reported to the csi owner; opened
	// up here until the driver does it.
	for dir := filepath.Dir(disk); strings.HasPrefix(dir, n.csiRoot+"/"); dir = filepath.Dir(dir) {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.CommandContext(ctx, "cp", "--sparse=always", boot, disk).CombinedOutput(); err != nil {
		t.Fatalf("copy boot disk: %v: %s", err, out)
	}
	pvName := "pv-" + n.ns + "-" + claim
	pv := &k8sv1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: k8sv1.PersistentVolumeSpec{
			Capacity:    k8sv1.ResourceList{k8sv1.ResourceStorage: *resource.NewQuantity(size, resource.BinarySI)},
			AccessModes: []k8sv1.PersistentVolumeAccessMode{k8sv1.ReadWriteOnce},
			PersistentVolumeSource: k8sv1.PersistentVolumeSource{CSI: &k8sv1.CSIPersistentVolumeSource{
				Driver: csi.DriverName, VolumeHandle: id,
			}},
			ClaimRef: &k8sv1.ObjectReference{Namespace: n.ns, Name: claim},
		},
	}
	if _, err := n.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		n.kube.CoreV1().PersistentVolumes().Delete(context.Background(), pvName, metav1.DeleteOptions{})
	})
	empty := ""
	pvc := &k8sv1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claim, Namespace: n.ns},
		Spec: k8sv1.PersistentVolumeClaimSpec{
			AccessModes:      []k8sv1.PersistentVolumeAccessMode{k8sv1.ReadWriteOnce},
			Resources:        k8sv1.VolumeResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceStorage: *resource.NewQuantity(size, resource.BinarySI)}},
			StorageClassName: &empty,
			VolumeName:       pvName,
		},
	}
	if _, err := n.kube.CoreV1().PersistentVolumeClaims(n.ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(disk)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// bridgeNetwork creates the NetworkAttachmentDefinition name on the node's
// bridge.
func (n *node) bridgeNetwork(ctx context.Context, name string) {
	n.t.Helper()
	conf, _ := json.Marshal(map[string]any{"cniVersion": "0.3.1", "name": name, "type": "cnv-bridge", "bridge": n.bridge})
	nad := &nadv1.NetworkAttachmentDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.ns,
			Annotations: map[string]string{"k8s.v1.cni.cncf.io/resourceName": "bridge.network.kubevirt.io/" + n.bridge}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: string(conf)},
	}
	if _, err := n.virt.NADs.Create(ctx, nad); err != nil {
		n.t.Fatal(err)
	}
}

// schedule creates vmi on the node as the scheduler would leave it: label,
// status.nodeName, phase Scheduled.
func (n *node) schedule(ctx context.Context, vmi *v1.VirtualMachineInstance) *v1.VirtualMachineInstance {
	t := n.t
	t.Helper()
	vmi.Namespace = n.ns
	if vmi.Labels == nil {
		vmi.Labels = map[string]string{}
	}
	vmi.Labels[v1.NodeNameLabel] = n.name
	got, err := n.virt.VMIs.Create(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	got.Status.NodeName = n.name
	got.Status.Phase = v1.Scheduled
	if got, err = n.virt.VMIs.UpdateStatus(ctx, got); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Leave nothing behind when a test fails midway.
		c := context.Background()
		if cur, err := n.virt.VMIs.Get(c, n.ns, vmi.Name); err == nil && len(cur.Finalizers) > 0 {
			cur.Finalizers = nil
			n.virt.VMIs.Update(c, cur)
		}
		n.lv.Undefine(c, n.ns+"_"+vmi.Name)
		for _, iface := range vmi.Spec.Domain.Devices.Interfaces {
			exec.Command("ip", "link", "del", tapName(got.UID, iface.Name)).Run()
		}
	})
	return got
}

// waitVMI polls the VMI until ok says so; it fails the test after timeout
// and shows the last state.
func (n *node) waitVMI(ctx context.Context, name string, timeout time.Duration, what string, ok func(*v1.VirtualMachineInstance) bool) *v1.VirtualMachineInstance {
	t := n.t
	t.Helper()
	var got *v1.VirtualMachineInstance
	testkit.Poll(t, timeout, fmt.Sprintf("vmi %s to be %s", name, what), func() (bool, error) {
		vmi, err := n.virt.VMIs.Get(ctx, n.ns, name)
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
		if err != nil {
			vmi = nil
		}
		got = vmi
		return ok(vmi), lastVMI{vmi}
	})
	return got
}

// lastVMI is the state a wait for a VMI saw last, shown when it times out.
type lastVMI struct{ vmi *v1.VirtualMachineInstance }

func (l lastVMI) Error() string {
	b, _ := json.MarshalIndent(l.vmi, "", "  ")
	return fmt.Sprintf("last:\n%s", b)
}

func condition(vmi *v1.VirtualMachineInstance, typ v1.VirtualMachineInstanceConditionType) *v1.VirtualMachineInstanceCondition {
	if vmi == nil {
		return nil
	}
	return conditionOf(vmi, typ)
}

func isTrue(vmi *v1.VirtualMachineInstance, typ v1.VirtualMachineInstanceConditionType) bool {
	c := condition(vmi, typ)
	return c != nil && c.Status == k8sv1.ConditionTrue
}
