package scheduler

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestMigrationTargetHoldsCapacity: from the moment a migration's target is
// chosen until the migration ends, the target holds the migrating VMI's
// requests: first the scheduler's own hold, then the migration's recorded
// targetNode. A failed migration releases them (and a VMI waiting for the
// room is placed); a succeeded one counts the VMI on its new node once.
// Targets are chosen with the same capacity count.
func TestMigrationTargetHoldsCapacity(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	pool := map[string]string{"mt/pool": "yes"}
	for _, n := range []string{"mt-src", "mt-dst", "mt-third"} {
		e.node(n, nodeSpec{cpu: "4", mem: "4Gi", labels: pool})
	}
	inPool := func(v *kubevirtv1.VirtualMachineInstance) { v.Spec.NodeSelector = pool }
	on := func(node string) func(*kubevirtv1.VirtualMachineInstance) {
		return func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.NodeSelector = map[string]string{"mt/pool": "yes", corev1.LabelHostname: node}
		}
	}
	e.vmi("mover", "3Gi", on("mt-src"))
	e.wantNode("mover", "mt-src")
	e.vmi("filler", "3Gi", on("mt-third"))
	e.wantNode("filler", "mt-third")

	// probe asks where a VMI of mem would go, pinned to node or anywhere
	// in the pool ("").
	probe := func(mem, node string) (string, error) {
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "probe"}}
		v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(mem)}
		inPool(v)
		if node != "" {
			on(node)(v)
		}
		return e.sched.Decide(v)
	}
	wantFull := func(when, mem, node string) {
		t.Helper()
		if got, err := probe(mem, node); err == nil || !strings.Contains(err.Error(), "insufficient memory") {
			t.Errorf("%s: a VMI of %s pinned to %q went to %q (err %v), want insufficient memory", when, mem, node, got, err)
		}
	}
	wantFits := func(when, mem, node string) {
		t.Helper()
		if got, err := probe(mem, node); err != nil || got != node {
			t.Errorf("%s: a VMI of %s pinned to %s: %q, %v", when, mem, node, got, err)
		}
	}
	wantFits("before any migration", "2Gi", "mt-dst")

	// The migration's target: the only node with room, held at once.
	mover, err := e.virt.VMIs.Get(ctx, e.ns, "mover")
	if err != nil {
		t.Fatal(err)
	}
	placement := mover.DeepCopy()
	placement.Spec.NodeSelector = pool
	placement.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
		NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
			Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpNotIn, Values: []string{"mt-src"}}}}}}}}
	target, err := e.sched.DecideMigration(placement)
	if err != nil || target != "mt-dst" {
		t.Fatalf("migration target %q (%v), want mt-dst, the only node with room", target, err)
	}
	wantFull("target chosen", "2Gi", "mt-dst")
	e.vmi("late", "2Gi", inPool)
	e.wantUnschedulable("late", "0/3 nodes are available: 3 insufficient memory.")

	// The migration records its target: it holds the room from then on.
	mig := e.migration("mover", "mt-src", "mt-dst")
	testkit.Until(t, 20*time.Second, "the scheduler's own hold handed over to the migration", func() bool {
		e.sched.mu.Lock()
		defer e.sched.mu.Unlock()
		_, held := e.sched.holds[mover.UID]
		return !held
	})
	wantFull("migration running", "2Gi", "mt-dst")

	// It fails: the room is free again, and the waiting VMI takes it.
	e.endMigration(mig, kubevirtv1.MigrationFailed)
	if n := e.waitBound("late"); n != "mt-dst" {
		t.Errorf("late placed on %q after the migration failed, want mt-dst", n)
	}

	// A second migration must go where there is room: none now.
	if target, err := e.sched.DecideMigration(placement); err == nil {
		t.Errorf("second migration got target %s with no node having room", target)
	}
	if err := e.kube.CoreV1().Nodes().Delete(ctx, "mt-dst", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.virt.VMIs.Delete(ctx, e.ns, "filler", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Until(t, 20*time.Second, "mt-third free", func() bool {
		got, err := probe("4Gi", "mt-third")
		return err == nil && got == "mt-third"
	})
	target, err = e.sched.DecideMigration(placement)
	if err != nil || target != "mt-third" {
		t.Fatalf("second migration target %q (%v), want mt-third", target, err)
	}
	mig = e.migration("mover", "mt-src", "mt-third")
	wantFull("second migration running", "2Gi", "mt-third")

	// It succeeds: the VMI runs on the target, counted there once.
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := e.virt.VMIs.Get(ctx, e.ns, "mover")
		if err != nil {
			return err
		}
		cur.Status.NodeName = "mt-third"
		_, err = e.virt.VMIs.UpdateStatus(ctx, cur)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	e.endMigration(mig, kubevirtv1.MigrationSucceeded)
	testkit.Until(t, 20*time.Second, "the source freed and the VMI counted once on its new node", func() bool {
		_, srcErr := probe("4Gi", "mt-src")
		got, err := probe("1Gi", "mt-third")
		return srcErr == nil && err == nil && got == "mt-third"
	})
	wantFull("after the migration", "2Gi", "mt-third")
}

// migration makes a VirtualMachineInstanceMigration of vmi that has
// recorded its target, as the brain's migration controller does.
func (e env) migration(vmi, source, target string) *kubevirtv1.VirtualMachineInstanceMigration {
	e.t.Helper()
	ctx := context.Background()
	m, err := e.virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "mig-", Namespace: e.ns},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: vmi}})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = e.virt.Migrations.Delete(context.Background(), e.ns, m.Name, metav1.DeleteOptions{}) })
	m.Status.Phase = kubevirtv1.MigrationRunning
	m.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{MigrationUID: m.UID, SourceNode: source, TargetNode: target}
	if m, err = e.virt.Migrations.UpdateStatus(ctx, m); err != nil {
		e.t.Fatal(err)
	}
	return m
}

// endMigration ends mig in phase.
func (e env) endMigration(mig *kubevirtv1.VirtualMachineInstanceMigration, phase kubevirtv1.VirtualMachineInstanceMigrationPhase) {
	e.t.Helper()
	ctx := context.Background()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := e.virt.Migrations.Get(ctx, mig.Namespace, mig.Name)
		if err != nil {
			return err
		}
		cur.Status.Phase = phase
		cur.Status.MigrationState.Completed = true
		cur.Status.MigrationState.Failed = phase == kubevirtv1.MigrationFailed
		_, err = e.virt.Migrations.UpdateStatus(ctx, cur)
		return err
	}); err != nil {
		e.t.Fatal(err)
	}
}
