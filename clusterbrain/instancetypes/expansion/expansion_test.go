package expansion

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
)

func TestScopes(t *testing.T) {
	for _, tc := range []struct {
		kind     string
		it, pref Scope
	}{
		{"", Cluster, Cluster},
		{"VirtualMachineClusterInstancetype", Cluster, Unknown},
		{"virtualmachineclusterinstancetypes", Cluster, Unknown},
		{"VirtualMachineInstancetype", Namespaced, Unknown},
		{"virtualmachineinstancetypes", Namespaced, Unknown},
		{"VirtualMachineClusterPreference", Unknown, Cluster},
		{"VirtualMachinePreference", Unknown, Namespaced},
		{"virtualmachinepreferences", Unknown, Namespaced},
		{"Pod", Unknown, Unknown},
	} {
		if got := InstancetypeScope(tc.kind); got != tc.it {
			t.Errorf("InstancetypeScope(%q) = %v, want %v", tc.kind, got, tc.it)
		}
		if got := PreferenceScope(tc.kind); got != tc.pref {
			t.Errorf("PreferenceScope(%q) = %v, want %v", tc.kind, got, tc.pref)
		}
	}
}

// TestApply is the rule both the VM controller and expand-spec follow;
// the cases marked "expand-spec used to" are where the two disagreed
// before they shared it.
func TestApply(t *testing.T) {
	small := func() *instancetypev1beta1.VirtualMachineInstancetypeSpec {
		return &instancetypev1beta1.VirtualMachineInstancetypeSpec{
			CPU:         instancetypev1beta1.CPUInstancetype{Guest: 4},
			Memory:      instancetypev1beta1.MemoryInstancetype{Guest: resource.MustParse("2Gi")},
			Annotations: map[string]string{"from": "instancetype"},
		}
	}
	topology := func(t instancetypev1beta1.PreferredCPUTopology) *instancetypev1beta1.VirtualMachinePreferenceSpec {
		return &instancetypev1beta1.VirtualMachinePreferenceSpec{CPU: &instancetypev1beta1.CPUPreferences{PreferredCPUTopology: &t},
			Annotations: map[string]string{"from": "preference", "only": "preference"}}
	}
	template := func() *kubevirtv1.VirtualMachineInstanceSpec {
		return &kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Devices: kubevirtv1.Devices{
			Disks: []kubevirtv1.Disk{{Name: "root"}, {Name: "cd", DiskDevice: kubevirtv1.DiskDevice{CDRom: &kubevirtv1.CDRomTarget{}}}}}}}
	}
	type topo struct{ sockets, cores, threads uint32 }
	for _, tc := range []struct {
		name  string
		edit  func(*kubevirtv1.VirtualMachineInstanceSpec)
		it    *instancetypev1beta1.VirtualMachineInstancetypeSpec
		pref  *instancetypev1beta1.VirtualMachinePreferenceSpec
		cpu   *topo
		errs  []string // fields in error
		check func(*testing.T, *kubevirtv1.VirtualMachineInstanceSpec, map[string]string)
	}{
		{name: "nothing", check: func(t *testing.T, s *kubevirtv1.VirtualMachineInstanceSpec, a map[string]string) {
			if s.Domain.CPU != nil || len(a) != 0 {
				t.Errorf("changed: %+v %v", s.Domain.CPU, a)
			}
		}},
		{name: "instancetype: sockets by default", it: small(), cpu: &topo{4, 1, 1},
			check: func(t *testing.T, s *kubevirtv1.VirtualMachineInstanceSpec, a map[string]string) {
				if s.Domain.Memory.Guest.String() != "2Gi" || a["from"] != "instancetype" {
					t.Errorf("memory %v annotations %v", s.Domain.Memory.Guest, a)
				}
			}},
		// expand-spec used to refuse every preference (400).
		{name: "preferred cores", it: small(), pref: topology(instancetypev1beta1.Cores), cpu: &topo{1, 4, 1},
			check: func(t *testing.T, _ *kubevirtv1.VirtualMachineInstanceSpec, a map[string]string) {
				if a["from"] != "instancetype" || a["only"] != "preference" {
					t.Errorf("annotations %v: the instance type's win, the preference fills the rest", a)
				}
			}},
		{name: "preferred threads", it: small(), pref: topology(instancetypev1beta1.Threads), cpu: &topo{1, 1, 4}},
		{name: "preferred spread", it: small(), pref: topology(instancetypev1beta1.Spread), cpu: &topo{2, 2, 1}},
		{name: "preference alone fills the template", pref: &instancetypev1beta1.VirtualMachinePreferenceSpec{
			Devices: &instancetypev1beta1.DevicePreferences{PreferredDiskBus: kubevirtv1.DiskBusSATA}},
			check: func(t *testing.T, s *kubevirtv1.VirtualMachineInstanceSpec, _ map[string]string) {
				d := s.Domain.Devices.Disks
				if d[0].Disk == nil || d[0].Disk.Bus != kubevirtv1.DiskBusSATA || d[1].Disk != nil {
					t.Errorf("disks %+v", d)
				}
			}},
		// expand-spec used to copy only CPU and memory.
		{name: "node selector and scheduler", it: func() *instancetypev1beta1.VirtualMachineInstancetypeSpec {
			it := small()
			it.NodeSelector, it.SchedulerName = map[string]string{"zone": "a"}, "custom"
			return it
		}(), cpu: &topo{4, 1, 1}, check: func(t *testing.T, s *kubevirtv1.VirtualMachineInstanceSpec, _ map[string]string) {
			if s.NodeSelector["zone"] != "a" || s.SchedulerName != "custom" {
				t.Errorf("selector %v scheduler %q", s.NodeSelector, s.SchedulerName)
			}
		}},
		{name: "template cpu conflicts", it: small(), edit: func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.CPU = &kubevirtv1.CPU{Cores: 2}
		}, errs: []string{"spec.template.spec.domain.cpu"}},
		{name: "template memory conflicts", it: small(), edit: func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			g := resource.MustParse("1Gi")
			s.Domain.Memory = &kubevirtv1.Memory{Guest: &g}
		}, errs: []string{"spec.template.spec.domain.memory.guest"}},
		// expand-spec used to accept these.
		{name: "template requests conflict", it: small(), edit: func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceMemory: resource.MustParse("1Gi")}
		}, errs: []string{"spec.template.spec.domain.resources.requests.cpu", "spec.template.spec.domain.resources.requests.memory"}},
		{name: "preference requires more", it: small(), pref: &instancetypev1beta1.VirtualMachinePreferenceSpec{
			Requirements: &instancetypev1beta1.PreferenceRequirements{CPU: &instancetypev1beta1.CPUPreferenceRequirement{Guest: 8}}},
			errs: []string{"spec.instancetype"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := template()
			if tc.edit != nil {
				tc.edit(spec)
			}
			annotations, errs := Apply(field.NewPath("spec", "template", "spec"), spec, tc.it, tc.pref)
			var fields []string
			for _, e := range errs {
				fields = append(fields, e.Field)
			}
			if strings.Join(fields, ",") != strings.Join(tc.errs, ",") {
				t.Fatalf("errors %v, want on %v", errs, tc.errs)
			}
			if len(errs) > 0 {
				return
			}
			if c := spec.Domain.CPU; tc.cpu != nil && (c == nil || (topo{c.Sockets, c.Cores, c.Threads}) != *tc.cpu) {
				t.Errorf("cpu %+v, want %+v", c, *tc.cpu)
			}
			if tc.check != nil {
				tc.check(t, spec, annotations)
			}
		})
	}
}

func TestRevisionSpec(t *testing.T) {
	spec, err := RevisionSpec[instancetypev1beta1.VirtualMachineInstancetypeSpec](
		[]byte(`{"kind":"VirtualMachineClusterInstancetype","spec":{"cpu":{"guest":3},"memory":{"guest":"1Gi"}}}`))
	if err != nil || spec.CPU.Guest != 3 || spec.Memory.Guest.String() != "1Gi" {
		t.Fatalf("%+v %v", spec, err)
	}
	if _, err := RevisionSpec[instancetypev1beta1.VirtualMachineInstancetypeSpec]([]byte("{")); err == nil {
		t.Error("broken data decoded")
	}
}
