package scheduler

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestReserveBeforeCreation places VMIs before they exist, as the VM
// controller does: reservations count against nodes at once, a VMI
// created with its reserved node's label is bound by exactly one write,
// and a reservation its VMI does not follow is corrected.
func TestReserveBeforeCreation(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	for _, n := range []string{"res-1", "res-2"} {
		e.node(n, nodeSpec{cpu: "4", mem: "2Gi", labels: map[string]string{"pool": "reserve"}})
	}
	newVMI := func(name string) *kubevirtv1.VirtualMachineInstance {
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: map[string]string{}},
			Spec: kubevirtv1.VirtualMachineInstanceSpec{NodeSelector: map[string]string{"pool": "reserve"}}}
		v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}
		return v
	}
	var node string
	testkit.Until(t, 10*time.Second, "the scheduler to reserve a node", func() bool {
		node = e.sched.Reserve(newVMI("r-0"))
		return node != ""
	})
	reserved := map[string]string{"r-0": node}
	perNode := map[string]int{node: 1}
	for i := 1; i < 4; i++ {
		name := fmt.Sprintf("r-%d", i)
		n := e.sched.Reserve(newVMI(name))
		if n == "" {
			t.Fatalf("%s: no node reserved with room left", name)
		}
		reserved[name] = n
		perNode[n]++
	}
	if perNode["res-1"] != 2 || perNode["res-2"] != 2 {
		t.Fatalf("reservations %v, want two on each node", perNode)
	}
	if n := e.sched.Reserve(newVMI("r-4")); n != "" {
		t.Fatalf("a fifth 1Gi VMI was given %s although the reservations fill both nodes", n)
	}
	e.sched.Unreserve(e.ns, "r-3")
	if n := e.sched.Reserve(newVMI("r-3")); n != reserved["r-3"] {
		t.Fatalf("after releasing r-3 its node %s was not free again (got %q)", reserved["r-3"], n)
	}

	// r-0..r-2 are created with their nodes' labels: one status write binds
	// each. r-3 is created without one: it is placed as any VMI, its label
	// written after.
	for i := 0; i < 4; i++ {
		name := fmt.Sprintf("r-%d", i)
		v := newVMI(name)
		if i < 3 {
			v.Labels[kubevirtv1.NodeNameLabel] = reserved[name]
		}
		got, err := e.virt.VMIs.Create(ctx, v)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			writes := countWrites(t, e, got)
			if writes != 1 {
				t.Errorf("r-0 was written %d times after its creation, want 1 (the binding)", writes)
			}
		}
	}
	for i := 0; i < 4; i++ {
		name := fmt.Sprintf("r-%d", i)
		e.wantNode(name, reserved[name])
	}
}

// countWrites watches vmi from its creation until it is bound and quiet
// for a second, and returns how many changes it saw.
func countWrites(t *testing.T, e env, vmi *kubevirtv1.VirtualMachineInstance) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w, err := e.virt.VMIs.Watch(ctx, e.ns, metav1.ListOptions{FieldSelector: "metadata.name=" + vmi.Name, ResourceVersion: vmi.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	n, bound := 0, false
	quiet := time.NewTimer(20 * time.Second)
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				return n
			}
			if ev.Type != watch.Modified {
				continue
			}
			n++
			if v, ok := ev.Object.(*kubevirtv1.VirtualMachineInstance); ok && v.Status.NodeName != "" && !bound {
				bound = true
				quiet.Reset(time.Second)
			}
		case <-quiet.C:
			if !bound {
				t.Fatalf("%s never bound", vmi.Name)
			}
			return n
		}
	}
}
