package migration

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{})
}

// TestMigrationsFailWithTheirReason runs the controller against the real
// control plane: every migration ends Failed, with KubeVirt's reason where
// KubeVirt would refuse it and "not implemented" where it would not; the
// VMIs are left alone.
func TestMigrationsFailWithTheirReason(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	testkit.InstallCRDs(t, cp)
	kube := cp.Clientset(t)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	c, err := New(Config{Kube: kube, Virt: virt})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() { stop(); <-done }()

	vmi := func(name string, phase kubevirtv1.VirtualMachineInstancePhase, conds ...kubevirtv1.VirtualMachineInstanceCondition) {
		t.Helper()
		v, err := virt.VMIs.Create(ctx, &kubevirtv1.VirtualMachineInstance{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Resources: kubevirtv1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}}}},
		})
		if err != nil {
			t.Fatal(err)
		}
		v.Status.Phase, v.Status.NodeName, v.Status.Conditions = phase, "node-a", conds
		if _, err := virt.VMIs.UpdateStatus(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	vmi("local-disk", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: corev1.ConditionFalse,
		Reason: kubevirtv1.VirtualMachineInstanceReasonDisksNotMigratable, Message: "cannot migrate VMI: PVC root is not shared"})
	vmi("movable", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: corev1.ConditionTrue})
	vmi("starting", kubevirtv1.Scheduled)

	for _, tc := range []struct{ vmi, want string }{
		{"local-disk", "Cannot migrate VMI, Reason: " + kubevirtv1.VirtualMachineInstanceReasonDisksNotMigratable + ", Message: cannot migrate VMI: PVC root is not shared"},
		{"movable", NotImplemented},
		{"starting", `cannot migrate VMI "starting": it is Scheduled, not Running`},
		{"missing", `the VMI "missing" does not exist`},
	} {
		mig, err := virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "kubevirt-migrate-vm-", Namespace: ns},
			Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: tc.vmi},
		})
		if err != nil {
			t.Fatal(err)
		}
		var got *kubevirtv1.VirtualMachineInstanceMigration
		if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			got, err = virt.Migrations.Get(ctx, ns, mig.Name)
			return err == nil && got.Status.Phase != "", err
		}); err != nil {
			t.Fatalf("migration of %s not settled: %v", tc.vmi, err)
		}
		st := got.Status.MigrationState
		if got.Status.Phase != kubevirtv1.MigrationFailed || st == nil || !st.Failed || !st.Completed || st.FailureReason != tc.want {
			t.Errorf("migration of %s: phase %s, state %+v; want Failed with %q", tc.vmi, got.Status.Phase, st, tc.want)
		}
		if tc.vmi != "missing" && st != nil && st.SourceNode != "node-a" {
			t.Errorf("migration of %s: source node %q", tc.vmi, st.SourceNode)
		}
		// Polled gently: the controller's event sink shares this client's
		// rate limit.
		if err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			events, err := kube.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + mig.Name})
			if err != nil {
				return false, err
			}
			for _, ev := range events.Items {
				if ev.Reason == ReasonFailed && ev.Type == corev1.EventTypeWarning && strings.Contains(ev.Message, tc.want) {
					return true, nil
				}
			}
			return false, nil
		}); err != nil {
			t.Errorf("no %s event for the migration of %s: %v", ReasonFailed, tc.vmi, err)
		}
	}
	// The guest is left where it runs.
	if v, err := virt.VMIs.Get(ctx, ns, "movable"); err != nil || v.Status.Phase != kubevirtv1.Running || v.Status.MigrationState != nil {
		t.Errorf("movable VMI changed: %+v %v", v.Status, err)
	}
}
