package migration

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{})
}

type env struct {
	t    *testing.T
	ctx  context.Context
	kube kubernetes.Interface
	virt *client.Set
	ns   string
	// requests are the controller's (not the scheduler's or the test's).
	requests *testkit.Requests
}

// setup runs the controller with the real scheduler against the real
// control plane; the tests play the node agents' part of the protocol
// (package migstate) by writing their keys.
func setup(t *testing.T) *env {
	cp := controlplane.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	testkit.InstallCRDs(t, cp)
	kube := cp.Clientset(t)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	sched, err := scheduler.New(scheduler.Config{Kube: kube, Virt: virt, Log: quiet, Retry: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	rc, requests := testkit.CountRequests(cp.RestConfig)
	cVirt, err := client.NewSet(rc)
	if err != nil {
		t.Fatal(err)
	}
	cKube := kubernetes.NewForConfigOrDie(rc)
	c, err := New(Config{Kube: cKube, Virt: cVirt, Placer: sched, Log: quiet, Dynamic: dynamic.NewForConfigOrDie(cp.RestConfig),
		EvacuationInterval: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{}, 2)
	go func() { _ = sched.Run(runCtx); done <- struct{}{} }()
	go func() { _ = c.Run(runCtx); done <- struct{}{} }()
	t.Cleanup(func() { stop(); <-done; <-done })
	return &env{t: t, ctx: ctx, kube: kube, virt: virt, ns: cp.Namespace(t), requests: requests}
}

// node makes a Ready, schedulable node with labels.
func (e *env) node(name string, labels map[string]string) {
	e.t.Helper()
	lbl := map[string]string{corev1.LabelHostname: name, scheduler.SchedulableLabel: "true"}
	for k, v := range labels {
		lbl[k] = v
	}
	res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("16Gi")}
	n, err := e.kube.CoreV1().Nodes().Create(e.ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbl}}, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = e.kube.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	n.Spec.Taints = nil
	if n, err = e.kube.CoreV1().Nodes().Update(e.ctx, n, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
	n.Status = corev1.NodeStatus{Capacity: res, Allocatable: res,
		Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}
	if _, err := e.kube.CoreV1().Nodes().UpdateStatus(e.ctx, n, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

// runningVMI makes a VMI running on node with the given conditions. It
// asks for a label no node has yet, so the scheduler leaves it alone until
// it runs.
func (e *env) runningVMI(name, node string, conds ...kubevirtv1.VirtualMachineInstanceCondition) {
	e.t.Helper()
	e.runningVMIWith(name, node, nil, conds...)
}

func (e *env) runningVMIWith(name, node string, strategy *kubevirtv1.EvictionStrategy, conds ...kubevirtv1.VirtualMachineInstanceCondition) {
	e.t.Helper()
	v, err := e.virt.VMIs.Create(e.ctx, &kubevirtv1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns, Labels: map[string]string{kubevirtv1.NodeNameLabel: node}},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{NodeSelector: map[string]string{"migration-test/eligible": "yes"},
			EvictionStrategy: strategy,
			Domain: kubevirtv1.DomainSpec{Resources: kubevirtv1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}}}},
	})
	if err != nil {
		e.t.Fatal(err)
	}
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := e.virt.VMIs.Get(e.ctx, e.ns, v.Name)
		if err != nil {
			return err
		}
		cur.Status.Phase, cur.Status.NodeName, cur.Status.Conditions = kubevirtv1.Running, node, conds
		_, err = e.virt.VMIs.UpdateStatus(e.ctx, cur)
		return err
	}); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) migrate(vmi string, added map[string]string) *kubevirtv1.VirtualMachineInstanceMigration {
	e.t.Helper()
	m, err := e.virt.Migrations.Create(e.ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "kubevirt-migrate-vm-", Namespace: e.ns},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: vmi, AddedNodeSelector: added},
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return m
}

// transitionsInto is how many migrations' transitions into phase the
// brain's phase-transition histogram counted.
func transitionsInto(phase kubevirtv1.VirtualMachineInstanceMigrationPhase) float64 {
	for _, f := range metrics.Default().Gather() {
		if f.Name != "kubevirt_vmi_migration_phase_transition_time_from_creation_seconds" {
			continue
		}
		for _, s := range f.Samples {
			if s.Suffix == "_count" && slices.Contains(s.Labels, metrics.Label{Name: "phase", Value: string(phase)}) {
				return s.Value
			}
		}
	}
	return 0
}

// waitPhase waits until the migration is in phase (or, with gone, deleted).
func (e *env) waitPhase(name string, phase kubevirtv1.VirtualMachineInstanceMigrationPhase) *kubevirtv1.VirtualMachineInstanceMigration {
	e.t.Helper()
	var got *kubevirtv1.VirtualMachineInstanceMigration
	if err := testkit.Wait(100*time.Millisecond, 30*time.Second, "migration "+name+" "+string(phase), func() (bool, error) {
		m, err := e.virt.Migrations.Get(e.ctx, e.ns, name)
		if err != nil {
			return false, testkit.Stop(err)
		}
		got = m
		return m.Status.Phase == phase, nil
	}); err != nil {
		e.t.Fatalf("migration %s not %s: %v (phase %s, state %+v)", name, phase, err, got.Status.Phase, got.Status.MigrationState)
	}
	return got
}

// nodeWrites plays a node agent: it writes its keys of the migration.
func (e *env) nodeWrites(name string, change func(*kubevirtv1.VirtualMachineInstanceMigrationState)) {
	e.t.Helper()
	if err := migstate.UpdateState(e.ctx, e.virt, e.ns, name, func(_ *kubevirtv1.VirtualMachineInstanceMigration, s *kubevirtv1.VirtualMachineInstanceMigrationState) bool {
		change(s)
		return true
	}); err != nil {
		e.t.Fatal(err)
	}
}

// updateNode changes a node.
func (e *env) updateNode(name string, change func(*corev1.Node)) {
	e.t.Helper()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := e.kube.CoreV1().Nodes().Get(e.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(n)
		_, err = e.kube.CoreV1().Nodes().Update(e.ctx, n, metav1.UpdateOptions{})
		return err
	}); err != nil {
		e.t.Fatal(err)
	}
}

var migratable = kubevirtv1.VirtualMachineInstanceCondition{Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: corev1.ConditionTrue}

// TestMigrationPhases: a migration goes through KubeVirt's phases as the
// nodes report; the target honours addedNodeSelector and is never the
// source; on success the VMI is bound to the target with the migration's
// state; a second migration of the same VMI (back) picks another node;
// deleting a running migration asks the source to abort and the object goes
// once the source reported.
func TestMigrationPhases(t *testing.T) {
	e := setup(t)
	for _, n := range []struct{ name, zone string }{{"mig-a", "a"}, {"mig-b", "b"}, {"mig-c", "c"}} {
		e.node(n.name, map[string]string{"zone": n.zone})
	}
	e.runningVMI("movable", "mig-a", migratable)
	// A MigrationPolicy for it (by namespace label and VMI label).
	if _, err := e.kube.CoreV1().Namespaces().Patch(e.ctx, e.ns, types.MergePatchType, []byte(`{"metadata":{"labels":{"team":"a"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	pol := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "migrations.kubevirt.io/v1alpha1", "kind": "MigrationPolicy",
		"metadata": map[string]any{"name": "slow-" + e.ns},
		"spec": map[string]any{"bandwidthPerMigration": "16Mi", "allowAutoConverge": true,
			"selectors": map[string]any{"namespaceSelector": map[string]any{"team": "a"}}}}}
	policies := dynamic.NewForConfigOrDie(controlplane.Shared(t).RestConfig).Resource(policyResource)
	if _, err := policies.Create(e.ctx, pol, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = policies.Delete(context.Background(), pol.GetName(), metav1.DeleteOptions{}) })
	for _, n := range []string{"mig-a", "mig-b", "mig-c"} {
		node, _ := e.kube.CoreV1().Nodes().Get(e.ctx, n, metav1.GetOptions{})
		node.Labels["migration-test/eligible"] = "yes"
		if _, err := e.kube.CoreV1().Nodes().Update(e.ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	succeededBefore := transitionsInto(kubevirtv1.MigrationSucceeded)
	mig := e.migrate("movable", map[string]string{"zone": "c"})
	got := e.waitPhase(mig.Name, kubevirtv1.MigrationPreparingTarget)
	if got.Labels[kubevirtv1.MigrationSelectorLabel] != "movable" {
		t.Errorf("labels %v lack %s", got.Labels, kubevirtv1.MigrationSelectorLabel)
	}
	st := got.Status.MigrationState
	if st.SourceNode != "mig-a" || st.TargetNode != "mig-c" || st.MigrationUID != mig.UID || st.VMIMConfigurationOptions == nil ||
		*st.VMIMConfigurationOptions.CompletionTimeoutPerGiB != 150 {
		t.Fatalf("scheduled state %+v", st)
	}
	if c := st.VMIMConfigurationOptions; st.MigrationPolicyName == nil || *st.MigrationPolicyName != "slow-"+e.ns ||
		c.BandwidthPerMigration.String() != "16Mi" || !*c.AllowAutoConverge {
		t.Errorf("policy %v, configuration %+v", st.MigrationPolicyName, c)
	}
	// The VMI's copy of the state is written after the migration's.
	testkit.Eventually(t, 30*time.Second, "the VMI's migrationState naming the target", func() error {
		vmi, err := e.virt.VMIs.Get(e.ctx, e.ns, "movable")
		if err != nil {
			return err
		}
		if st := vmi.Status.MigrationState; st == nil || st.TargetNode != "mig-c" {
			return fmt.Errorf("vmi migrationState %+v", st)
		}
		return nil
	})
	e.nodeWrites(mig.Name, func(s *kubevirtv1.VirtualMachineInstanceMigrationState) { s.TargetNodeAddress = "10.0.0.3" })
	e.waitPhase(mig.Name, kubevirtv1.MigrationTargetReady)
	e.nodeWrites(mig.Name, func(s *kubevirtv1.VirtualMachineInstanceMigrationState) {
		now := metav1.Now()
		s.StartTimestamp = &now
	})
	e.waitPhase(mig.Name, kubevirtv1.MigrationRunning)
	e.nodeWrites(mig.Name, func(s *kubevirtv1.VirtualMachineInstanceMigrationState) {
		now := metav1.Now()
		s.EndTimestamp, s.Completed = &now, true
	})
	got = e.waitPhase(mig.Name, kubevirtv1.MigrationSucceeded)
	var phases []string
	for _, p := range got.Status.PhaseTransitionTimestamps {
		phases = append(phases, string(p.Phase))
	}
	if strings.Join(phases, ",") != "Pending,Scheduling,Scheduled,PreparingTarget,TargetReady,Running,Succeeded" {
		t.Errorf("phases %v", phases)
	}
	testkit.Eventually(t, 30*time.Second, "the transition into Succeeded in the phase-transition histogram", func() error {
		if n := transitionsInto(kubevirtv1.MigrationSucceeded); n != succeededBefore+1 {
			return fmt.Errorf("%v transitions into Succeeded counted, %v before", n, succeededBefore)
		}
		return nil
	})
	vmi, err := e.virt.VMIs.Get(e.ctx, e.ns, "movable")
	if err != nil || vmi.Status.NodeName != "mig-c" || vmi.Labels[kubevirtv1.NodeNameLabel] != "mig-c" ||
		vmi.Status.MigrationState == nil || !vmi.Status.MigrationState.Completed || vmi.Status.MigrationState.Failed {
		t.Fatalf("vmi after the migration: node %s labels %v state %+v (%v)", vmi.Status.NodeName, vmi.Labels, vmi.Status.MigrationState, err)
	}

	// Back: any node but the source mig-c.
	back := e.migrate("movable", nil)
	got = e.waitPhase(back.Name, kubevirtv1.MigrationPreparingTarget)
	if tn := got.Status.MigrationState.TargetNode; tn == "mig-c" || tn == "" {
		t.Fatalf("second migration targets %q", tn)
	}
	// A third one while the second runs: refused as KubeVirt does.
	third := e.migrate("movable", nil)
	got = e.waitPhase(third.Name, kubevirtv1.MigrationFailed)
	if !strings.Contains(got.Status.MigrationState.FailureReason, "in-flight migration detected") {
		t.Errorf("concurrent migration failed with %q", got.Status.MigrationState.FailureReason)
	}
	// Cancel the second one: abortRequested, then the source's report.
	e.nodeWrites(back.Name, func(s *kubevirtv1.VirtualMachineInstanceMigrationState) {
		now := metav1.Now()
		s.TargetNodeAddress, s.StartTimestamp = "10.0.0.2", &now
	})
	e.waitPhase(back.Name, kubevirtv1.MigrationRunning)
	if err := e.virt.Migrations.Delete(e.ctx, e.ns, back.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := testkit.Wait(100*time.Millisecond, 30*time.Second, "abortRequested", func() (bool, error) {
		m, err := e.virt.Migrations.Get(e.ctx, e.ns, back.Name)
		if err != nil {
			return false, testkit.Stop(err)
		}
		return m.Status.MigrationState.AbortRequested, nil
	}); err != nil {
		t.Fatalf("abort not requested: %v", err)
	}
	e.nodeWrites(back.Name, func(s *kubevirtv1.VirtualMachineInstanceMigrationState) {
		now := metav1.Now()
		s.EndTimestamp, s.Completed, s.Failed = &now, true, true
		s.AbortStatus, s.FailureReason = kubevirtv1.MigrationAbortSucceeded, "migration aborted"
	})
	if err := testkit.Wait(100*time.Millisecond, 30*time.Second, "the cancelled migration to go", func() (bool, error) {
		_, err := e.virt.Migrations.Get(e.ctx, e.ns, back.Name)
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatalf("cancelled migration not removed: %v", err)
	}
	vmi, _ = e.virt.VMIs.Get(e.ctx, e.ns, "movable")
	if s := vmi.Status.MigrationState; vmi.Status.NodeName != "mig-c" || s == nil || s.MigrationUID != back.UID || !s.Failed ||
		s.AbortStatus != kubevirtv1.MigrationAbortSucceeded {
		t.Errorf("vmi after the cancel: node %s state %+v", vmi.Status.NodeName, s)
	}
}

// TestMigrationsRefused: migrations KubeVirt would refuse fail at once with
// its reason, and the VMIs are left alone.
func TestMigrationsRefused(t *testing.T) {
	e := setup(t)
	e.node("ref-a", nil)
	e.runningVMI("local-disk", "ref-a", kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: corev1.ConditionFalse,
		Reason: kubevirtv1.VirtualMachineInstanceReasonDisksNotMigratable, Message: "cannot migrate VMI with non-shared HostDisk"})
	e.runningVMI("alone", "ref-a", migratable)
	for _, tc := range []struct{ vmi, want string }{
		{"local-disk", "Cannot migrate VMI, Reason: " + kubevirtv1.VirtualMachineInstanceReasonDisksNotMigratable + ", Message: cannot migrate VMI with non-shared HostDisk"},
		{"missing", `the VMI "missing" does not exist`},
		// One node only: nowhere to go but the source.
		{"alone", "no node to migrate VMI alone to"},
	} {
		mig := e.migrate(tc.vmi, nil)
		got := e.waitPhase(mig.Name, kubevirtv1.MigrationFailed)
		st := got.Status.MigrationState
		if st == nil || !st.Failed || !st.Completed || !strings.Contains(st.FailureReason, tc.want) {
			t.Errorf("migration of %s: state %+v; want Failed with %q", tc.vmi, st, tc.want)
		}
	}
	if v, err := e.virt.VMIs.Get(e.ctx, e.ns, "alone"); err != nil || v.Status.NodeName != "ref-a" || v.Status.MigrationState != nil {
		t.Errorf("vmi alone changed: %+v %v", v.Status, err)
	}
}

// TestEvacuation: on a node tainted kubevirt.io/drain, a LiveMigrate VMI
// gets an evacuation migration, evacuationNodeName and KubeVirt's
// EvictionRequested condition, which go when it has moved; an External one
// only the mark; a None one nothing; a LiveMigrate VMI that cannot migrate
// stays unmarked with KubeVirt's FailedCreate event (and NonEvictable), a
// LiveMigrateIfPossible one that cannot migrate stays unmarked and unwarned.
func TestEvacuation(t *testing.T) {
	e := setup(t)
	e.node("evac-a", map[string]string{"migration-test/eligible": "yes"})
	e.node("evac-b", nil) // eligible once the VMIs run
	strategy := func(s kubevirtv1.EvictionStrategy) *kubevirtv1.EvictionStrategy { return &s }
	notMigratable := kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: corev1.ConditionFalse,
		Reason: kubevirtv1.VirtualMachineInstanceReasonDisksNotMigratable, Message: "cannot migrate VMI with non-shared HostDisk"}
	e.runningVMIWith("live", "evac-a", strategy(kubevirtv1.EvictionStrategyLiveMigrate), migratable)
	e.runningVMIWith("external", "evac-a", strategy(kubevirtv1.EvictionStrategyExternal), migratable)
	e.runningVMIWith("none", "evac-a", strategy(kubevirtv1.EvictionStrategyNone), migratable)
	e.runningVMIWith("stuck", "evac-a", strategy(kubevirtv1.EvictionStrategyLiveMigrate), notMigratable)
	e.runningVMIWith("ifpossible", "evac-a", strategy(kubevirtv1.EvictionStrategyLiveMigrateIfPossible), notMigratable)
	e.updateNode("evac-b", func(n *corev1.Node) { n.Labels["migration-test/eligible"] = "yes" })
	e.updateNode("evac-a", func(n *corev1.Node) {
		n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: "kubevirt.io/drain", Effect: corev1.TaintEffectNoSchedule})
	})
	var evacuation *kubevirtv1.VirtualMachineInstanceMigration
	if err := testkit.Wait(200*time.Millisecond, 30*time.Second, "an evacuation migration of live", func() (bool, error) {
		migs, err := e.virt.Migrations.List(e.ctx, e.ns, metav1.ListOptions{})
		if err != nil {
			return false, testkit.Stop(err)
		}
		for _, m := range migs {
			if m.Spec.VMIName != "live" || m.Annotations[kubevirtv1.EvacuationMigrationAnnotation] != "evac-a" {
				t.Errorf("unexpected migration %s of %s (%v)", m.Name, m.Spec.VMIName, m.Annotations)
			}
			evacuation = m
		}
		return len(migs) == 1, nil
	}); err != nil {
		t.Fatalf("no evacuation migration of live: %v", err)
	}
	marked := func(v *kubevirtv1.VirtualMachineInstance) string {
		for _, c := range v.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineInstanceEvictionRequested {
				return fmt.Sprintf("%s|%s|%s|%s", v.Status.EvacuationNodeName, c.Status, c.Reason, c.Message)
			}
		}
		return v.Status.EvacuationNodeName + "|no condition"
	}
	want := map[string]string{"live": "evac-a|True|EvictionRequested|VMI is marked for eviction",
		"external": "evac-a|True|EvictionRequested|VMI is marked for eviction",
		"none":     "|no condition", "stuck": "|no condition", "ifpossible": "|no condition"}
	testkit.Eventually(t, 30*time.Second, "evacuationNodeName and EvictionRequested as KubeVirt sets them", func() error {
		for name, w := range want {
			v, err := e.virt.VMIs.Get(e.ctx, e.ns, name)
			if err != nil {
				return err
			}
			if got := marked(v); got != w {
				return fmt.Errorf("vmi %s: %q, want %q", name, got, w)
			}
		}
		return nil
	})
	eventsOf := func(name string) int {
		events, err := e.kube.CoreV1().Events(e.ns).List(e.ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name + ",reason=" + ReasonFailedEvacuation})
		if err != nil {
			t.Fatal(err)
		}
		return len(events.Items)
	}
	testkit.Eventually(t, 30*time.Second, "a "+ReasonFailedEvacuation+" event on the VMI that cannot migrate", func() error {
		if eventsOf("stuck") == 0 {
			return errors.New("none yet")
		}
		return nil
	})
	if n := eventsOf("ifpossible"); n != 0 {
		t.Errorf("%d %s events on the LiveMigrateIfPossible VMI that cannot migrate; it was not asked to move", n, ReasonFailedEvacuation)
	}
	for name, want := range map[string]bool{"live": false, "stuck": true, "ifpossible": false, "none": false} {
		v, err := e.virt.VMIs.Get(e.ctx, e.ns, name)
		if err != nil {
			t.Fatal(err)
		}
		if got := NonEvictable(v, kubevirtv1.EvictionStrategyNone); got != want {
			t.Errorf("NonEvictable(%s) = %v, want %v", name, got, want)
		}
	}

	// The evacuation succeeds (the nodes' part played here): the VMI on
	// the target loses the mark and the condition.
	e.waitPhase(evacuation.Name, kubevirtv1.MigrationPreparingTarget)
	e.nodeWrites(evacuation.Name, func(s *kubevirtv1.VirtualMachineInstanceMigrationState) { s.TargetNodeAddress = "10.0.0.4" })
	e.nodeWrites(evacuation.Name, func(s *kubevirtv1.VirtualMachineInstanceMigrationState) {
		now := metav1.Now()
		s.StartTimestamp, s.EndTimestamp, s.Completed = &now, &now, true
	})
	e.waitPhase(evacuation.Name, kubevirtv1.MigrationSucceeded)
	testkit.Eventually(t, 30*time.Second, "the evacuated VMI unmarked on evac-b", func() error {
		v, err := e.virt.VMIs.Get(e.ctx, e.ns, "live")
		if err != nil {
			return err
		}
		if got := marked(v); v.Status.NodeName != "evac-b" || got != "|no condition" {
			return fmt.Errorf("on %q: %q", v.Status.NodeName, got)
		}
		return nil
	})
	// Each pass (one List of the KubeVirt CRs) found the draining node in
	// the informer's cache: the evacuation lists no Node.
	if passes, lists := e.requests.Lists("/apis/kubevirt.io/v1/kubevirts"), e.requests.Lists("/api/v1/nodes"); passes < 3 || lists > 1 {
		t.Errorf("%d evacuation passes listed the Nodes %d times, want at least 3 passes and at most the informer's first list", passes, lists)
	}
}
