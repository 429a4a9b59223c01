package metrics

import (
	"sort"
	"strings"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

const none = "<none>"

func orNone(s string) string {
	if s == "" {
		return none
	}
	return s
}

// vmiInfoLabels are the labels KubeVirt's kubevirt_vmi_info carries and
// kubevirt_vmi_phase_count sums by.
var vmiInfoLabels = []string{"node", "phase", "os", "workload", "flavor", "instance_type", "preference",
	"guest_os_kernel_release", "guest_os_machine", "guest_os_name", "guest_os_version_id"}

func vmiInfo(vmi *kubevirtv1.VirtualMachineInstance) []string {
	a, l := vmi.Annotations, vmi.Labels
	os := a["vm.kubevirt.io/os"]
	if os == "" {
		for k := range l {
			if strings.HasPrefix(k, "os.template.kubevirt.io/") {
				os = strings.TrimPrefix(k, "os.template.kubevirt.io/")
			}
		}
	}
	g := vmi.Status.GuestOSInfo
	return []string{
		orNone(vmi.Status.NodeName), strings.ToLower(string(vmi.Status.Phase)), orNone(os),
		orNone(a["vm.kubevirt.io/workload"]), orNone(a["vm.kubevirt.io/flavor"]),
		orNone(firstOf(a, "kubevirt.io/instancetype-name", "kubevirt.io/cluster-instancetype-name")),
		orNone(firstOf(a, "kubevirt.io/preference-name", "kubevirt.io/cluster-preference-name")),
		orNone(g.KernelRelease), orNone(g.Machine), orNone(g.Name), orNone(g.VersionID),
	}
}

func firstOf(m map[string]string, keys ...string) string {
	for _, k := range keys {
		if v := m[k]; v != "" {
			return v
		}
	}
	return ""
}

func labels(names, values []string) []Label {
	ls := make([]Label, len(names))
	for i := range names {
		ls[i] = Label{names[i], values[i]}
	}
	return ls
}

// VMICollector exposes kubevirt_vmi_info (one series per VMI) and
// kubevirt_vmi_phase_count (VMIs per node, phase and the info labels) from
// the VMIs list returns, e.g. an informer's cache.
func VMICollector(list func() []*kubevirtv1.VirtualMachineInstance) Collector {
	return CollectorFunc(func() []Family {
		info := Family{Name: "kubevirt_vmi_info", Type: TypeGauge, Help: "Information about VirtualMachineInstances."}
		phase := Family{Name: "kubevirt_vmi_phase_count", Type: TypeGauge, Help: "Sum of VMIs per phase and node."}
		counts := map[string]float64{}
		keys := map[string][]string{}
		for _, vmi := range list() {
			v := vmiInfo(vmi)
			info.Samples = append(info.Samples, Sample{Labels: append(labels(vmiInfoLabels, v),
				Label{"namespace", vmi.Namespace}, Label{"name", vmi.Name}), Value: 1})
			k := strings.Join(v, "\xff")
			counts[k]++
			keys[k] = v
		}
		ks := make([]string, 0, len(keys))
		for k := range keys {
			ks = append(ks, k)
		}
		sort.Strings(ks)
		for _, k := range ks {
			phase.Samples = append(phase.Samples, Sample{Labels: labels(vmiInfoLabels, keys[k]), Value: counts[k]})
		}
		return []Family{info, phase}
	})
}

// MigrationCollector exposes virt-controller's migration families over the
// migrations list returns: kubevirt_vmi_migrations_in_{unset,pending,
// scheduling,running}_phase (counts; Scheduled, PreparingTarget and
// TargetReady count as running, as upstream) and
// kubevirt_vmi_migration_succeeded / _failed{vmi,vmim,namespace} (1 for
// each ended migration), and the Unix times a migration started and ended
// (kubevirt_vmi_migration_start_time_seconds{node,namespace,name,
// migration_name}, _end_time_seconds{...,status}), from its
// migrationState; node is the source node.
func MigrationCollector(list func() []*kubevirtv1.VirtualMachineInstanceMigration) Collector {
	return CollectorFunc(func() []Family {
		var unset, pending, scheduling, running float64
		succeeded := Family{Name: "kubevirt_vmi_migration_succeeded", Type: TypeGauge, Help: "Indicates if the VMI migration succeeded."}
		failed := Family{Name: "kubevirt_vmi_migration_failed", Type: TypeGauge, Help: "Indicates if the VMI migration failed."}
		started := Family{Name: "kubevirt_vmi_migration_start_time_seconds", Type: TypeGauge, Help: "The time at which the migration started."}
		ended := Family{Name: "kubevirt_vmi_migration_end_time_seconds", Type: TypeGauge, Help: "The time at which the migration ended."}
		for _, m := range list() {
			if st := m.Status.MigrationState; st != nil && st.StartTimestamp != nil {
				ls := []Label{{"node", st.SourceNode}, {"namespace", m.Namespace}, {"name", m.Spec.VMIName}, {"migration_name", m.Name}}
				started.Samples = append(started.Samples, Sample{Labels: ls, Value: float64(st.StartTimestamp.Unix())})
				if st.EndTimestamp != nil && (st.Completed || st.Failed) {
					status := "succeeded"
					if st.Failed {
						status = "failed"
					}
					ended.Samples = append(ended.Samples, Sample{Labels: append(ls, Label{"status", status}), Value: float64(st.EndTimestamp.Unix())})
				}
			}
			ls := []Label{{"vmi", m.Spec.VMIName}, {"vmim", m.Name}, {"namespace", m.Namespace}}
			switch m.Status.Phase {
			case kubevirtv1.MigrationPhaseUnset:
				unset++
			case kubevirtv1.MigrationPending:
				pending++
			case kubevirtv1.MigrationScheduling:
				scheduling++
			case kubevirtv1.MigrationSucceeded:
				succeeded.Samples = append(succeeded.Samples, Sample{Labels: ls, Value: 1})
			case kubevirtv1.MigrationFailed:
				failed.Samples = append(failed.Samples, Sample{Labels: ls, Value: 1})
			default:
				running++
			}
		}
		gauge := func(name, help string, v float64) Family {
			return Family{Name: name, Type: TypeGauge, Help: help, Samples: []Sample{{Value: v}}}
		}
		return []Family{
			gauge("kubevirt_vmi_migrations_in_unset_phase", "Number of current unset migrations.", unset),
			gauge("kubevirt_vmi_migrations_in_pending_phase", "Number of current pending migrations.", pending),
			gauge("kubevirt_vmi_migrations_in_scheduling_phase", "Number of current scheduling migrations.", scheduling),
			gauge("kubevirt_vmi_migrations_in_running_phase", "Number of current running migrations.", running),
			succeeded, failed, started, ended,
		}
	})
}
