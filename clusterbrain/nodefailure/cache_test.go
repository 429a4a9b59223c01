package nodefailure

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// TestChecksReadNodesFromTheCache: against a real API server, the checks
// (every 100 ms here, 2 s in the brain) keep a node's taints without
// listing the Nodes or the Leases: each informer's first list is the only
// one. A List of every Node, then of every Lease, per check cost the API
// server (and the brain, decoding them) the whole fleet every two seconds.
func TestChecksReadNodesFromTheCache(t *testing.T) {
	cp := controlplane.Shared(t)
	rc, requests := testkit.CountRequests(cp.RestConfig)
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	admin := cp.Clientset(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	name := fmt.Sprintf("nodefailure-%05d", rand.IntN(100000))
	t.Cleanup(func() {
		_ = admin.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{})
		_ = admin.CoordinationV1().Leases(corev1.NamespaceNodeLease).Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	n, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name,
		Labels: map[string]string{LabelManagedBy: "standalone"}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The agent renews its Lease but says it is not ready: the node gets
	// the not-ready taints.
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionFalse, Reason: "Test"}}
	if _, err := admin.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	renewed := metav1.NewMicroTime(time.Now())
	if _, err := admin.CoordinationV1().Leases(corev1.NamespaceNodeLease).Create(ctx, &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: coordinationv1.LeaseSpec{RenewTime: &renewed}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Here each check reads the clock three times (the check's time, the
	// taints' time, the next check's delay).
	var clock atomic.Int64
	c, err := New(Config{Kube: kube, Virt: &client.Set{}, Interval: 100 * time.Millisecond,
		Now: func() time.Time { clock.Add(1); return time.Now() }})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	testkit.Until(t, time.Minute, "the not-ready taints", func() bool {
		got, err := admin.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		return err == nil && slices.ContainsFunc(got.Spec.Taints, func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeNotReady })
	})
	testkit.Until(t, 2*time.Minute, "twenty checks", func() bool { return clock.Load() > 60 })
	leases := "/apis/coordination.k8s.io/v1/namespaces/" + corev1.NamespaceNodeLease + "/leases"
	for _, path := range []string{"/api/v1/nodes", leases} {
		if n := requests.Lists(path); n > 1 {
			t.Errorf("twenty checks listed %s %d times, want at most the informer's first list", path, n)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
