package vmcontroller

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestSyncDirect drives Sync by hand against informers and the real API,
// with no worker running, sample-controller style.
func TestSyncDirect(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	testkit.InstallCRDs(t, cp)
	virt, _ := client.NewSet(cp.RestConfig)
	e := env{t: t, kube: cp.Clientset(t), virt: virt, ns: cp.Namespace(t)}
	c, err := New(Config{Kube: e.kube, Virt: virt, Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	if !c.startInformers(ctx) {
		t.Fatal("caches never synced")
	}
	cached := func(what string, ok func(*kubevirtv1.VirtualMachine) bool) {
		t.Helper()
		testkit.Until(t, 10*time.Second, "the cache to show "+what, func() bool {
			obj, found, _ := c.vms.GetStore().GetByKey(e.ns + "/direct")
			return found && ok(obj.(*kubevirtv1.VirtualMachine))
		})
	}
	key := e.ns + "/direct"

	e.newVM("direct", func(vm *kubevirtv1.VirtualMachine) { vm.Spec.RunStrategy = strategy(kubevirtv1.RunStrategyHalted) })
	cached("the vm", func(*kubevirtv1.VirtualMachine) bool { return true })
	if after, err := c.Sync(ctx, key); err != nil || after != 0 {
		t.Fatalf("sync halted: %v %v", after, err)
	}
	vm, _ := virt.VMs.Get(ctx, e.ns, "direct")
	if vm.Status.PrintableStatus != kubevirtv1.VirtualMachineStatusStopped || vm.Status.RunStrategy != kubevirtv1.RunStrategyHalted {
		t.Errorf("halted status %+v", vm.Status)
	}
	if _, err := virt.VMIs.Get(ctx, e.ns, "direct"); err == nil {
		t.Error("halted vm got a vmi")
	}

	// A pending back-off holds the start and asks to be synced again then.
	retryAt := metav1.NewTime(time.Now().Add(time.Hour))
	vm.Spec.RunStrategy = strategy(kubevirtv1.RunStrategyAlways)
	if vm, err = virt.VMs.Update(ctx, vm); err != nil {
		t.Fatal(err)
	}
	vm.Status.StartFailure = &kubevirtv1.VirtualMachineStartFailure{ConsecutiveFailCount: 3, RetryAfterTimestamp: &retryAt}
	if _, err := virt.VMs.UpdateStatus(ctx, vm); err != nil {
		t.Fatal(err)
	}
	cached("the back-off", func(v *kubevirtv1.VirtualMachine) bool { return v.Status.StartFailure != nil })
	after, err := c.Sync(ctx, key)
	if err != nil || after < 59*time.Minute || after > time.Hour {
		t.Fatalf("sync in back-off: after %v err %v", after, err)
	}
	vm, _ = virt.VMs.Get(ctx, e.ns, "direct")
	if vm.Status.PrintableStatus != kubevirtv1.VirtualMachineStatusCrashLoopBackOff {
		t.Errorf("printableStatus %q, want CrashLoopBackOff", vm.Status.PrintableStatus)
	}

	// Once the back-off is over, Sync creates the VMI.
	c.failures.Delete(vm.UID) // the back-off this controller would remember
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		vm, _ = virt.VMs.Get(ctx, e.ns, "direct")
		vm.Status.StartFailure = nil
		_, err := virt.VMs.UpdateStatus(ctx, vm)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	cached("no back-off", func(v *kubevirtv1.VirtualMachine) bool { return v.Status.StartFailure == nil })
	if _, err := c.Sync(ctx, key); err != nil {
		t.Fatal(err)
	}
	vmi, err := virt.VMIs.Get(ctx, e.ns, "direct")
	if err != nil {
		t.Fatalf("no vmi after sync: %v", err)
	}
	if vmi.Annotations["kubevirt.io/vm-generation"] == "" {
		t.Errorf("vmi annotations %v", vmi.Annotations)
	}
	// Syncing again changes nothing (the VMI exists under its fixed name).
	if _, err := c.Sync(ctx, key); err != nil {
		t.Fatal(err)
	}
	list, _ := virt.VMIs.List(ctx, e.ns, metav1.ListOptions{})
	if len(list) != 1 {
		t.Errorf("%d vmis after a repeated sync", len(list))
	}
}
