package vmcontroller

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestPlacedBeforeCreation runs the controller with the real scheduler as
// its Placer, sharing one VM and one VMI informer as the brain does: a VM
// that fits gets a VMI born with its node's label and bound to that node;
// one that fits nowhere gets a VMI without a node, which the scheduler
// marks unschedulable, and the VM says so.
func TestPlacedBeforeCreation(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cp := controlplane.Shared(t)
	res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("8Gi")}
	for _, name := range []string{"placer-a", "placer-b"} {
		n, err := e.kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			scheduler.SchedulableLabel: "true", "kubernetes.io/hostname": name, "pool": "placer"}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.kube.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
		n.Spec.Taints = nil
		if n, err = e.kube.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		n.Status = corev1.NodeStatus{Capacity: res, Allocatable: res,
			Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}
		if _, err := e.kube.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	vms, vmis := e.virt.VMs.Informer(e.ns, 0, nil), e.virt.VMIs.Informer(e.ns, 0, nil)
	sch, err := scheduler.New(scheduler.Config{RestConfig: cp.RestConfig, Log: log, VMIInformer: vmis, Retry: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(Config{RestConfig: cp.RestConfig, Log: log, Placer: sch, VMInformer: vms, VMIInformer: vmis})
	if err != nil {
		t.Fatal(err)
	}
	go vms.RunWithContext(ctx)
	go vmis.RunWithContext(ctx)
	done := make(chan struct{}, 2)
	go func() { _ = sch.Run(ctx); done <- struct{}{} }()
	go func() { _ = c.Run(ctx); done <- struct{}{} }()
	defer func() { cancel(); <-done; <-done }()

	// The scheduler places only once its caches have synced and show the
	// nodes; until then a VMI is created without a node.
	probe := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "probe"},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{NodeSelector: map[string]string{"pool": "placer"}}}
	err = testkit.Wait(testkit.Interval, 15*time.Second, "the scheduler to place a probe", func() (bool, error) {
		return sch.Reserve(probe) != "", nil
	})
	sch.Unreserve(e.ns, probe.Name)
	if err != nil {
		t.Fatal(err)
	}
	// Resource version "0": the watch starts from the API server's cache as
	// it is, rather than waiting (at most 3s) for it to catch up with etcd,
	// which only a progress notification (every 5s) may bring.
	w, err := e.virt.VMIs.Watch(ctx, e.ns, metav1.ListOptions{FieldSelector: "metadata.name=placed", ResourceVersion: "0"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	e.newVM("placed", func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.Template.Spec.NodeSelector = map[string]string{"pool": "placer"}
	})
	_, vmi := e.waitVM("placed", "a bound VMI", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil && vmi.Status.NodeName != ""
	})
	select {
	case ev := <-w.ResultChan():
		v, ok := ev.Object.(*kubevirtv1.VirtualMachineInstance)
		if !ok || ev.Type != watch.Added || v.Labels[kubevirtv1.NodeNameLabel] != vmi.Status.NodeName {
			var labels map[string]string
			if ok {
				labels = v.Labels
			}
			t.Errorf("first event of the vmi: %s with labels %v, want it added with the label of node %s", ev.Type, labels, vmi.Status.NodeName)
		}
	case <-time.After(5 * time.Second):
		t.Error("no watch event for the vmi")
	}
	if n := vmi.Status.NodeName; !strings.HasPrefix(n, "placer-") || vmi.Labels[kubevirtv1.NodeNameLabel] != n || vmi.Status.Phase != kubevirtv1.Scheduled {
		t.Errorf("vmi bound to %q with label %q, phase %s", n, vmi.Labels[kubevirtv1.NodeNameLabel], vmi.Status.Phase)
	}

	e.newVM("nowhere", func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.Template.Spec.NodeSelector = map[string]string{"pool": "placer", "absent": "label"}
	})
	vm, vmi := e.waitVM("nowhere", "ErrorUnschedulable", status(kubevirtv1.VirtualMachineStatusUnschedulable))
	if vmi == nil || vmi.Labels[kubevirtv1.NodeNameLabel] != "" || vmi.Status.NodeName != "" {
		t.Errorf("unschedulable vm %s: vmi %+v", vm.Name, vmi)
	}
}
