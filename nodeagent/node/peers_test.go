package node

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nodevirt/nodevirt/nodeagent/kube"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// TestPeersFollowNodesWithoutListing: the agent learns its peers' addresses
// (added, changed, gone) from a watch, and a heartbeat lists no Node: with
// a List of every Node per heartbeat, a fleet of N agents read N² Nodes
// every heartbeat period.
func TestPeersFollowNodesWithoutListing(t *testing.T) {
	cp := controlplane.Shared(t)
	rc, requests := testkit.CountRequests(cp.RestConfig)
	kc, err := kube.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	admin := cp.Clientset(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const annotation = "nodevirt.io/test-peer-address"
	prefix := fmt.Sprintf("peers-%05d", rand.IntN(100000))
	t.Cleanup(func() {
		for _, n := range []string{"self", "a", "b", "c"} {
			_ = admin.CoreV1().Nodes().Delete(context.Background(), prefix+"-"+n, metav1.DeleteOptions{})
			_ = admin.CoordinationV1().Leases(corev1.NamespaceNodeLease).Delete(context.Background(), prefix+"-"+n, metav1.DeleteOptions{})
		}
	})
	peer := func(name, addr string) {
		t.Helper()
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: prefix + "-" + name,
			Labels: map[string]string{LabelManagedBy: "standalone"}, Annotations: map[string]string{annotation: addr}}}
		if _, err := admin.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	peer("a", "192.0.2.1:8443")
	peer("b", "192.0.2.2:8443")

	reg, err := New(Config{Name: prefix + "-self", InternalIP: "192.0.2.10", Heartbeat: 200 * time.Millisecond,
		PeerAnnotation: annotation}, kc)
	if err != nil {
		t.Fatal(err)
	}
	if standalone, err := reg.Register(ctx); err != nil || !standalone {
		t.Fatalf("register: standalone %v, err %v", standalone, err)
	}
	// The agent's own Node carries an address too: it is no peer of itself.
	patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:"192.0.2.10:8443"}}}`, annotation)
	if _, err := admin.CoreV1().Nodes().Patch(ctx, prefix+"-self", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- reg.Run(ctx) }()
	peersAre := func(want ...string) func() bool {
		return func() bool { return slices.Equal(reg.Peers(), want) }
	}
	testkit.Until(t, time.Minute, "the two peers", peersAre("192.0.2.1:8443", "192.0.2.2:8443"))
	peer("c", "192.0.2.3:8443")
	testkit.Until(t, time.Minute, "the third peer", peersAre("192.0.2.1:8443", "192.0.2.2:8443", "192.0.2.3:8443"))
	if err := admin.CoreV1().Nodes().Delete(ctx, prefix+"-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Until(t, time.Minute, "the deleted peer gone", peersAre("192.0.2.2:8443", "192.0.2.3:8443"))

	// Heartbeats go on; none lists the Nodes.
	const beats = 5
	first := reg.LastRenewal()
	renewals := 0
	testkit.Until(t, 2*time.Minute, fmt.Sprintf("%d heartbeats", beats), func() bool {
		if r := reg.LastRenewal(); !r.Equal(first) {
			first, renewals = r, renewals+1
		}
		return renewals >= beats
	})
	// One List fills the watch's cache when it starts.
	if n := requests.Lists("/api/v1/nodes"); n > 1 {
		t.Fatalf("the agent listed the Nodes %d times over its heartbeats, want at most the watch's first list", n)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
