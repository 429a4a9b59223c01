package bridgemarker_test

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/nodevirt/nodevirt/cni/cnitest"
	"github.com/nodevirt/nodevirt/nodeagent/bridgemarker"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

func makeNode(t *testing.T, cs kubernetes.Interface, name string) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := cs.CoreV1().Nodes().Create(context.Background(), n, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
}

func nodeResource(t *testing.T, cs kubernetes.Interface, node, key string) (capacity, allocatable *resource.Quantity) {
	t.Helper()
	n, err := cs.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if q, ok := n.Status.Capacity[corev1.ResourceName(key)]; ok {
		capacity = &q
	}
	if q, ok := n.Status.Allocatable[corev1.ResourceName(key)]; ok {
		allocatable = &q
	}
	return capacity, allocatable
}

func TestNodePublisher(t *testing.T) {
	cs := controlplane.Shared(t).Clientset(t)
	makeNode(t, cs, "bm-node-1")
	p := &bridgemarker.NodePublisher{Client: cs, NodeName: "bm-node-1"}
	ctx := context.Background()
	ka, kb := bridgemarker.ResourcePrefix+"bra", bridgemarker.ResourcePrefix+"brb"
	if err := p.Publish(ctx, map[string]int64{ka: 1024, kb: 1000}); err != nil {
		t.Fatal(err)
	}
	// (managedFields would name FieldManager, but this control plane
	// records none, so only the values are checked.)
	c, a := nodeResource(t, cs, "bm-node-1", kb)
	if c == nil || a == nil || c.Value() != 1000 || a.Value() != 1000 {
		t.Fatalf("brb: capacity %v allocatable %v", c, a)
	}
	if err := p.Publish(ctx, map[string]int64{ka: 1023}); err != nil {
		t.Fatal(err)
	}
	if c, a := nodeResource(t, cs, "bm-node-1", kb); c != nil || a != nil {
		t.Fatalf("brb not removed: %v %v", c, a)
	}
	if c, _ := nodeResource(t, cs, "bm-node-1", ka); c == nil || c.Value() != 1023 {
		t.Fatalf("bra = %v, want 1023", c)
	}
}

// TestBridgeAppearsOnNode: a bridge created on the "node" (a namespace)
// shows up on the Node object within a second, and goes when it goes.
func TestBridgeAppearsOnNode(t *testing.T) {
	cs := controlplane.Shared(t).Clientset(t)
	makeNode(t, cs, "bm-node-2")
	ns, err := cnitest.NewNS("nvbm")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	nh, _ := netns.GetFromPath(ns.Path)
	defer nh.Close()
	m, err := bridgemarker.New(bridgemarker.Config{Publisher: &bridgemarker.NodePublisher{Client: cs, NodeName: "bm-node-2"}, NetNS: &nh})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = m.Run(ctx) }()
	h, _ := netlink.NewHandleAt(nh, unix.NETLINK_ROUTE)
	defer h.Close()

	key := bridgemarker.ResourcePrefix + "brnode"
	waitNode := func(want bool) time.Duration {
		start := time.Now()
		for time.Since(start) < time.Second {
			c, _ := nodeResource(t, cs, "bm-node-2", key)
			if (c != nil && c.Value() == 1024) == want {
				return time.Since(start)
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("node resource %s present=%v not reached within 1s", key, want)
		return 0
	}
	if err := h.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "brnode"}}); err != nil {
		t.Fatal(err)
	}
	t.Logf("bridge on the Node %v after creation", waitNode(true))
	if err := h.LinkDel(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "brnode"}}); err != nil {
		t.Fatal(err)
	}
	t.Logf("bridge gone from the Node %v after deletion", waitNode(false))
}
