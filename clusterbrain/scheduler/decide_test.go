package scheduler

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestDecideSpreadsAndAssumes calls Decide by hand (no worker running):
// equal nodes are used in turn, and assumed placements count at once.
func TestDecideSpreadsAndAssumes(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	testkit.InstallCRDs(t, cp)
	e := env{kube: kubernetes.NewForConfigOrDie(cp.RestConfig), t: t}
	e.virt, _ = client.NewSet(cp.RestConfig)
	for _, n := range []string{"dec-a", "dec-b", "dec-c"} {
		e.node(n, nodeSpec{cpu: "8", mem: "3Gi", labels: map[string]string{"pool": "decide"}})
	}
	s, err := New(Config{Kube: e.kube, Virt: e.virt})
	if err != nil {
		t.Fatal(err)
	}
	if !s.startInformers(ctx) {
		t.Fatal("caches never synced")
	}
	_ = testkit.Wait(20*time.Millisecond, 5*time.Second, "the snapshot's three nodes", func() (bool, error) {
		return len(s.snapshot()) >= 3, nil
	})
	used := map[string]int{}
	for i := 0; i < 9; i++ {
		vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: "x", Name: fmt.Sprint(i), UID: types.UID(fmt.Sprint("uid-", i))},
			Spec: kubevirtv1.VirtualMachineInstanceSpec{NodeSelector: map[string]string{"pool": "decide"}}}
		vmi.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}
		node, _, p, err := s.decide(vmi, nil)
		if err != nil {
			t.Fatalf("vmi %d: %v", i, err)
		}
		used[node]++
		s.assumed[vmi.UID] = assumption{node: node, p: p}
	}
	for _, n := range []string{"dec-a", "dec-b", "dec-c"} {
		if used[n] != 3 {
			t.Errorf("placements %v, want 3 on each node", used)
		}
	}
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: "x", Name: "one-more", UID: "uid-more"},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{NodeSelector: map[string]string{"pool": "decide"}}}
	vmi.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}
	_, err = s.Decide(vmi)
	var fe *FitError
	if err == nil || !asFit(err, &fe) {
		t.Fatalf("tenth vmi: %v, want a FitError", err)
	}
}

func asFit(err error, fe **FitError) bool {
	f, ok := err.(*FitError)
	*fe = f
	return ok
}
