package nodefailure

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestTimesNodesFromWhatItSaw: a brain that starts (or gets the API back)
// finds a Lease renewed long ago and still gives the node its full grace;
// the taint comes once the renewal has not moved for longer than that.
func TestTimesNodesFromWhatItSaw(t *testing.T) {
	ctx := context.Background()
	start := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	old := metav1.NewMicroTime(start.Add(-10 * time.Minute))
	kube := fake.NewSimpleClientset(
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{LabelManagedBy: "standalone"}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}},
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n2", Labels: map[string]string{LabelManagedBy: "standalone"}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}},
		&coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "n1", Namespace: corev1.NamespaceNodeLease}, Spec: coordinationv1.LeaseSpec{RenewTime: &old}},
		&coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "n2", Namespace: corev1.NamespaceNodeLease}, Spec: coordinationv1.LeaseSpec{RenewTime: &old}},
	)
	now := start
	nodes := coreinformers.NewNodeInformer(kube, 0, cache.Indexers{})
	leases := NewLeaseInformer(kube)
	go nodes.RunWithContext(t.Context())
	go leases.RunWithContext(t.Context())
	if !cache.WaitForCacheSync(t.Context().Done(), nodes.HasSynced, leases.HasSynced) {
		t.Fatal("caches not filled")
	}
	c, err := New(Config{Kube: kube, Virt: &client.Set{}, Nodes: nodes, Leases: leases, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	unreachable := func(name string) bool {
		n, err := kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeUnreachable })
	}
	if err := c.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if unreachable("n1") || unreachable("n2") {
		t.Fatal("a lease renewed before the brain looked made the node unreachable at once")
	}
	// n2 renews; n1 does not.
	now = start.Add(15 * time.Second)
	fresh := metav1.NewMicroTime(now)
	l, _ := kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, "n2", metav1.GetOptions{})
	l.Spec.RenewTime = &fresh
	if _, err := kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Until(t, time.Minute, "n2's renewal in the lease cache", func() bool {
		l := c.cachedLease("n2")
		return l != nil && l.Spec.RenewTime.Equal(&fresh)
	})
	now = start.Add(c.cfg.Grace + time.Second)
	if err := c.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if !unreachable("n1") || unreachable("n2") {
		t.Fatalf("after the grace: n1 unreachable %v (want true), n2 %v (want false)", unreachable("n1"), unreachable("n2"))
	}

	// The API goes away, then comes back much later: n2 gets a full grace
	// again although its renewal is now old.
	kube.PrependReactor("*", "leases", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("api server down")
	})
	now = start.Add(5 * time.Minute)
	if err := c.Sync(ctx); err == nil {
		t.Fatal("sync without the API succeeded")
	}
	kube.ReactionChain = kube.ReactionChain[1:]
	now = start.Add(6 * time.Minute)
	if err := c.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if unreachable("n2") {
		t.Fatal("back from an API outage, the brain tainted a node before a full grace")
	}
}

// TestLaggingCacheAsksTheAPI: a Lease cache that stopped following the
// API server (a broken watch not yet opened again) still holds old
// renewals; before the nodes are judged on them, the check reads their
// Leases from the API server (one by one for a few nodes, one List for
// many) and finds them renewing.
func TestLaggingCacheAsksTheAPI(t *testing.T) {
	for _, n := range []int{1, lateReads + 2} {
		t.Run(fmt.Sprintf("%d nodes", n), func(t *testing.T) { laggingCache(t, n) })
	}
}

func laggingCache(t *testing.T, count int) {
	ctx := context.Background()
	start := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	renewed := metav1.NewMicroTime(start)
	kube := fake.NewSimpleClientset()
	var names []string
	for i := range count {
		name := fmt.Sprintf("n%d", i)
		names = append(names, name)
		if _, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{LabelManagedBy: "standalone"}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: corev1.NamespaceNodeLease},
			Spec: coordinationv1.LeaseSpec{RenewTime: &renewed}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	nodes := coreinformers.NewNodeInformer(kube, 0, cache.Indexers{})
	go nodes.RunWithContext(t.Context())
	// The Lease informer stops after its first list: its cache keeps
	// what it read then.
	leases := NewLeaseInformer(kube)
	leaseCtx, stopLeases := context.WithCancel(t.Context())
	go leases.RunWithContext(leaseCtx)
	if !cache.WaitForCacheSync(t.Context().Done(), nodes.HasSynced, leases.HasSynced) {
		t.Fatal("caches not filled")
	}
	stopLeases()
	testkit.Until(t, time.Minute, "the lease informer stopped", leases.IsStopped)
	now := start
	c, err := New(Config{Kube: kube, Virt: &client.Set{}, Nodes: nodes, Leases: leases, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	// The nodes renew every few seconds; only the API server sees it.
	for now.Before(start.Add(c.cfg.Grace + 5*time.Second)) {
		now = now.Add(5 * time.Second)
		for _, name := range names {
			l, err := kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			r := metav1.NewMicroTime(now)
			l.Spec.RenewTime = &r
			if _, err := kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Update(ctx, l, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Sync(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range names {
		if cached := c.cachedLease(name); !cached.Spec.RenewTime.Equal(&renewed) {
			t.Fatalf("the stopped cache moved to %s: the test shows nothing", cached.Spec.RenewTime)
		}
		n, err := kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(n.Spec.Taints) > 0 {
			t.Fatalf("node %s, renewing its Lease, was tainted %v from a lagging cache", name, taintKeys(n.Spec.Taints))
		}
	}
}

// TestChecksAtTheDeadline: the next check comes just after a node's grace
// or window + margin ends when that is sooner than the interval, and a
// renewal keeps the time it was first seen (the watch's, not a later
// poll's).
func TestChecksAtTheDeadline(t *testing.T) {
	start := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	c, err := New(Config{Kube: fake.NewSimpleClientset(), Virt: &client.Set{}, Grace: 20 * time.Second, Window: 30 * time.Second,
		Margin: 10 * time.Second, Interval: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	renewal := start.Add(-time.Second)
	c.observe("n1", renewal, start)
	if o := c.observe("n1", renewal, start.Add(1500*time.Millisecond)); !o.at.Equal(start) {
		t.Fatalf("a renewal seen again moved its sighting to %s, want %s", o.at, start)
	}
	if got := c.nextCheck(start.Add(5 * time.Second)); got != 2*time.Second {
		t.Errorf("far from any deadline: next check in %s, want the interval", got)
	}
	if got := c.nextCheck(start.Add(19500 * time.Millisecond)); got != 510*time.Millisecond {
		t.Errorf("0.5 s before the grace ends: next check in %s, want 510ms", got)
	}
	if got := c.nextCheck(start.Add(39 * time.Second)); got != 1010*time.Millisecond {
		t.Errorf("1 s before window + margin: next check in %s, want 1.01s", got)
	}
	if got := c.nextCheck(start.Add(41 * time.Second)); got != 2*time.Second {
		t.Errorf("past every deadline: next check in %s, want the interval", got)
	}
}
