package metrics

import (
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

func scrape(t *testing.T, r *Registry) string {
	t.Helper()
	srv := httptest.NewServer(r.Handler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
		t.Fatalf("content type %q", ct)
	}
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func mustContain(t *testing.T, text string, lines ...string) {
	t.Helper()
	for _, l := range lines {
		if !strings.Contains(text, l+"\n") {
			t.Errorf("exposition lacks %q:\n%s", l, text)
		}
	}
}

func TestExposition(t *testing.T) {
	r := NewRegistry()
	rec := r.Counter("nodevirt_reconcile_total", "Reconciles per controller and result.", "controller", "result")
	rec.With("vm", "ok").Add(3)
	rec.With("vm", "error").Inc()
	rec.With("vm", "ok").Add(-5) // ignored: counters only grow
	r.Gauge("kubemacpool_mac_pool_used", "MACs allocated.").With().Set(12)
	h := r.Histogram("nodevirt_cni_operation_duration_seconds", "CNI latency.", []float64{0.01, 0.1, 1}, "op")
	for _, v := range []float64{0.005, 0.05, 0.05, 2} {
		h.With("ADD").Observe(v)
	}
	r.Gauge("odd", "Escapes \\ and\nnewlines.", "v").With("a\"b\\c\nd").Set(1)
	out := scrape(t, r)
	mustContain(t, out,
		"# TYPE nodevirt_reconcile_total counter",
		`nodevirt_reconcile_total{controller="vm",result="error"} 1`,
		`nodevirt_reconcile_total{controller="vm",result="ok"} 3`,
		"kubemacpool_mac_pool_used 12",
		"# TYPE nodevirt_cni_operation_duration_seconds histogram",
		`nodevirt_cni_operation_duration_seconds_bucket{op="ADD",le="0.01"} 1`,
		`nodevirt_cni_operation_duration_seconds_bucket{op="ADD",le="0.1"} 3`,
		`nodevirt_cni_operation_duration_seconds_bucket{op="ADD",le="1"} 3`,
		`nodevirt_cni_operation_duration_seconds_bucket{op="ADD",le="+Inf"} 4`,
		`nodevirt_cni_operation_duration_seconds_sum{op="ADD"} 2.105`,
		`nodevirt_cni_operation_duration_seconds_count{op="ADD"} 4`,
		`# HELP odd Escapes \\ and\nnewlines.`,
		`odd{v="a\"b\\c\nd"} 1`,
	)
	if strings.Index(out, `le="0.01"`) > strings.Index(out, `le="+Inf"`) {
		t.Error("buckets out of order")
	}
}

func TestVMICollector(t *testing.T) {
	vmi := func(name, node string, phase kubevirtv1.VirtualMachineInstancePhase) *kubevirtv1.VirtualMachineInstance {
		return &kubevirtv1.VirtualMachineInstance{
			ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, Annotations: map[string]string{"vm.kubevirt.io/os": "fedora"}},
			Status:     kubevirtv1.VirtualMachineInstanceStatus{Phase: phase, NodeName: node},
		}
	}
	r := NewRegistry()
	r.Register(VMICollector(func() []*kubevirtv1.VirtualMachineInstance {
		return []*kubevirtv1.VirtualMachineInstance{vmi("a", "n1", kubevirtv1.Running), vmi("b", "n1", kubevirtv1.Running), vmi("c", "n2", kubevirtv1.Pending)}
	}))
	out := scrape(t, r)
	rest := `os="fedora",workload="<none>",flavor="<none>",instance_type="<none>",preference="<none>",guest_os_kernel_release="<none>",guest_os_machine="<none>",guest_os_name="<none>",guest_os_version_id="<none>"`
	mustContain(t, out,
		`kubevirt_vmi_phase_count{node="n1",phase="running",`+rest+`} 2`,
		`kubevirt_vmi_phase_count{node="n2",phase="pending",`+rest+`} 1`,
	)
}

// timed gives m the migrationState of a migration that started at
// 1700000000 and, unless it is still running, ended 12 s later.
func timed(m *kubevirtv1.VirtualMachineInstanceMigration, failed bool) *kubevirtv1.VirtualMachineInstanceMigration {
	start := metav1.Unix(1700000000, 0)
	st := &kubevirtv1.VirtualMachineInstanceMigrationState{SourceNode: "src", StartTimestamp: &start}
	if m.Status.Phase != kubevirtv1.MigrationRunning {
		end := metav1.Unix(1700000012, 0)
		st.EndTimestamp, st.Completed, st.Failed = &end, !failed, failed
	}
	m.Status.MigrationState = st
	return m
}

func TestMigrationCollector(t *testing.T) {
	mig := func(name string, phase kubevirtv1.VirtualMachineInstanceMigrationPhase) *kubevirtv1.VirtualMachineInstanceMigration {
		return &kubevirtv1.VirtualMachineInstanceMigration{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
			Spec: kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: "vm-" + name}, Status: kubevirtv1.VirtualMachineInstanceMigrationStatus{Phase: phase}}
	}
	r := NewRegistry()
	r.Register(MigrationCollector(func() []*kubevirtv1.VirtualMachineInstanceMigration {
		return []*kubevirtv1.VirtualMachineInstanceMigration{mig("new", ""), mig("waits", kubevirtv1.MigrationPending),
			mig("prep", kubevirtv1.MigrationPreparingTarget), mig("run", kubevirtv1.MigrationRunning),
			timed(mig("ok", kubevirtv1.MigrationSucceeded), false), timed(mig("bad", kubevirtv1.MigrationFailed), true),
			timed(mig("moving", kubevirtv1.MigrationRunning), false)}
	}))
	out := scrape(t, r)
	mustContain(t, out,
		`kubevirt_vmi_migrations_in_unset_phase 1`, `kubevirt_vmi_migrations_in_pending_phase 1`,
		`kubevirt_vmi_migrations_in_scheduling_phase 0`, `kubevirt_vmi_migrations_in_running_phase 3`,
		`kubevirt_vmi_migration_succeeded{vmi="vm-ok",vmim="ok",namespace="ns"} 1`,
		`kubevirt_vmi_migration_failed{vmi="vm-bad",vmim="bad",namespace="ns"} 1`,
		`kubevirt_vmi_migration_start_time_seconds{node="src",namespace="ns",name="vm-ok",migration_name="ok"} 1700000000`,
		`kubevirt_vmi_migration_end_time_seconds{node="src",namespace="ns",name="vm-ok",migration_name="ok",status="succeeded"} 1700000012`,
		`kubevirt_vmi_migration_end_time_seconds{node="src",namespace="ns",name="vm-bad",migration_name="bad",status="failed"} 1700000012`,
		`kubevirt_vmi_migration_start_time_seconds{node="src",namespace="ns",name="vm-moving",migration_name="moving"} 1700000000`,
	)
	if strings.Contains(out, `migration_name="moving",status=`) {
		t.Errorf("a running migration has an end time:\n%s", out)
	}
	if strings.Contains(out, `vmim="run"`) {
		t.Errorf("a running migration in the ended families:\n%s", out)
	}
}
