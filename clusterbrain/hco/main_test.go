package hco

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/poolstate"
	"github.com/nodevirt/nodevirt/clusterbrain/hostpathprovisioner"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

var installOnce sync.Once

// env is one test's world: a namespace holding the HyperConverged, a
// running role for it, and clients.
type env struct {
	t    *testing.T
	ns   string
	kube kubernetes.Interface
	virt *client.Set
	ctrl *Controller
	// brainErr is what the role's BrainHealth reports.
	mu       sync.Mutex
	brainErr error
}

func testLog() *slog.Logger {
	if os.Getenv("HCO_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// newEnv installs the CRDs, makes a namespace and starts the role on it.
// Cluster-scoped children and test Nodes are removed when the test ends,
// since tests share one control plane.
func newEnv(t *testing.T, opts ...func(*Config)) *env {
	t.Helper()
	cp := controlplane.Shared(t)
	installOnce.Do(func() {
		testkit.InstallCRDs(t, cp)
	})
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, ns: cp.Namespace(t), kube: cp.Clientset(t), virt: virt}
	cfg := Config{Namespace: e.ns, Kube: e.kube, Virt: virt, Log: testLog(), Version: "v1.2.3",
		BrainHealth: func() error { e.mu.Lock(); defer e.mu.Unlock(); return e.brainErr }}
	for _, o := range opts {
		o(&cfg)
	}
	ctrl, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.ctrl = ctrl
	// The brain runs the HostPathProvisioner controller beside: the HPP
	// child is judged from the status it writes.
	hpp, err := hostpathprovisioner.New(hostpathprovisioner.Config{Kube: e.kube, Virt: virt, Version: "v1.2.3", Log: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	go func() { defer func() { done <- struct{}{} }(); _ = ctrl.Run(ctx) }()
	go func() { defer func() { done <- struct{}{} }(); _ = hpp.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		<-done
		e.cleanupClusterScoped()
	})
	return e
}

// servePools makes a test Node report the HostPathProvisioner's pools
// Ready, as a node agent does, with the labels its placement selects.
func (e *env) servePools(node string, labels map[string]string, pools ...string) {
	e.t.Helper()
	var np poolstate.NodePools
	for _, p := range pools {
		np.Pools = append(np.Pools, poolstate.PoolState{Name: p, Path: "/pools/" + p, Provisioner: HPPName, Phase: poolstate.PhaseReady})
	}
	meta := map[string]any{"annotations": map[string]string{poolstate.AnnotationNodePools: poolstate.Encode(np)}}
	if labels != nil {
		meta["labels"] = labels
	}
	patch, _ := json.Marshal(map[string]any{"metadata": meta})
	if _, err := e.kube.CoreV1().Nodes().Patch(context.Background(), node, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) cleanupClusterScoped() {
	ctx := context.Background()
	_ = e.virt.CDIs.Delete(ctx, "", CDIName, metav1.DeleteOptions{})
	_ = e.virt.NetworkAddonsConfigs.Delete(ctx, "", CNAOName, metav1.DeleteOptions{})
	_ = e.virt.HostPathProvisioners.Delete(ctx, "", HPPName, metav1.DeleteOptions{})
	_ = e.kube.StorageV1().StorageClasses().DeleteCollection(ctx, metav1.DeleteOptions{},
		metav1.ListOptions{LabelSelector: hostpathprovisioner.LabelOwner + "=" + HPPName})
	nodes, _ := e.kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: "nodevirt.io/test-node"})
	if nodes != nil {
		for _, n := range nodes.Items {
			_ = e.kube.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{})
		}
	}
	// Let the HyperConverged go without a brain to remove its finalizer.
	hcos, _ := e.virt.HyperConvergeds.List(ctx, e.ns, metav1.ListOptions{})
	for _, hc := range hcos {
		patch := []byte(`{"metadata":{"finalizers":null}}`)
		_, _ = e.virt.HyperConvergeds.Patch(ctx, hc.Namespace, hc.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		_ = e.virt.HyperConvergeds.Delete(ctx, hc.Namespace, hc.Name, metav1.DeleteOptions{})
	}
}

func (e *env) setBrainErr(err error) {
	e.mu.Lock()
	e.brainErr = err
	e.mu.Unlock()
}

// node registers a Node as a nodeagent does, Ready or not.
func (e *env) node(name string, ready bool, msg string) {
	e.t.Helper()
	ctx := context.Background()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name,
		Labels: map[string]string{schedulableLabel: "true", "nodevirt.io/test-node": "true"}}}
	got, err := e.kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		got, err = e.kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	}
	if err != nil {
		e.t.Fatal(err)
	}
	status := corev1.ConditionTrue
	if !ready {
		status = corev1.ConditionFalse
	}
	got.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status, Reason: "NodeAgentStatus",
		Message: msg, LastHeartbeatTime: metav1.Now()}}
	if _, err := e.kube.CoreV1().Nodes().UpdateStatus(ctx, got, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

// create makes a HyperConverged from JSON (the spec and metadata as a user
// writes them).
func (e *env) create(name, manifest string) *hcov1beta1.HyperConverged {
	e.t.Helper()
	hc := &hcov1beta1.HyperConverged{}
	if manifest != "" {
		if err := json.Unmarshal([]byte(manifest), hc); err != nil {
			e.t.Fatal(err)
		}
	}
	hc.Name, hc.Namespace = name, e.ns
	out, err := e.virt.HyperConvergeds.Create(context.Background(), hc)
	if err != nil {
		e.t.Fatalf("create hyperconverged: %v", err)
	}
	return out
}

func (e *env) get(name string) *hcov1beta1.HyperConverged {
	e.t.Helper()
	hc, err := e.virt.HyperConvergeds.Get(context.Background(), e.ns, name)
	if err != nil {
		e.t.Fatal(err)
	}
	return hc
}

func condition(hc *hcov1beta1.HyperConverged, typ string) *metav1.Condition {
	return meta.FindStatusCondition(hc.Status.Conditions, typ)
}

// update applies f to the stored HyperConverged, retrying on conflicts.
func (e *env) update(name string, f func(*hcov1beta1.HyperConverged)) {
	e.t.Helper()
	for i := 0; ; i++ {
		hc := e.get(name)
		f(hc)
		_, err := e.virt.HyperConvergeds.Update(context.Background(), hc)
		if err == nil {
			return
		}
		if !apierrors.IsConflict(err) || i > 20 {
			e.t.Fatalf("update hyperconverged: %v", err)
		}
	}
}
