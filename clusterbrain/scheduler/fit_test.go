package scheduler

import (
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
)

func TestDemandOf(t *testing.T) {
	nads := func(ns, name string) (string, error) {
		switch ns + "/" + name {
		case "vms/br1":
			return BridgePrefix + "br1", nil
		case "other/plain":
			return "", nil
		}
		return "", errors.New("no such nad")
	}
	mem := resource.MustParse("1Gi")
	for _, tc := range []struct {
		name     string
		edit     func(*kubevirtv1.VirtualMachineInstance)
		cpu, mem int64
		ext      map[corev1.ResourceName]int64
		err      bool
	}{
		{name: "nothing asked: one vcpu at 100m", cpu: 100},
		{name: "requests win", edit: func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1500m"), corev1.ResourceMemory: resource.MustParse("2Gi")}
			v.Spec.Domain.Memory = &kubevirtv1.Memory{Guest: &mem}
		}, cpu: 1500, mem: 2 << 30},
		{name: "guest memory, topology vcpus", edit: func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Domain.Memory = &kubevirtv1.Memory{Guest: &mem}
			v.Spec.Domain.CPU = &kubevirtv1.CPU{Sockets: 2, Cores: 2}
		}, cpu: 400, mem: 1 << 30},
		{name: "limits when nothing else", edit: func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Domain.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")}
		}, cpu: 100, mem: 512 << 20},
		{name: "one bridge unit per interface on a nad", edit: func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Networks = []kubevirtv1.Network{
				{Name: "a", NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "br1"}}},
				{Name: "b", NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "vms/br1"}}},
				{Name: "c", NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "other/plain"}}},
				{Name: "pod", NetworkSource: kubevirtv1.NetworkSource{Pod: &kubevirtv1.PodNetwork{}}},
			}
		}, cpu: 100, ext: map[corev1.ResourceName]int64{BridgePrefix + "br1": 2}},
		{name: "missing nad", edit: func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Networks = []kubevirtv1.Network{{Name: "a", NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "gone"}}}}
		}, err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: "vms", Name: "v"}}
			if tc.edit != nil {
				tc.edit(vmi)
			}
			d, err := demandOf(vmi, overcommit.Default, nads)
			if (err != nil) != tc.err {
				t.Fatalf("err = %v, want error %v", err, tc.err)
			}
			if tc.err {
				return
			}
			if d.cpu != tc.cpu || d.mem != tc.mem || len(d.ext) != len(tc.ext) {
				t.Errorf("demand = %+v, want cpu %d mem %d ext %v", d, tc.cpu, tc.mem, tc.ext)
			}
			for k, v := range tc.ext {
				if d.ext[k] != v {
					t.Errorf("ext %s = %d, want %d", k, d.ext[k], v)
				}
			}
		})
	}
}

// TestFilter is the fit rule, node by node: each case one reason a node
// refuses a VMI (or none).
func TestFilter(t *testing.T) {
	node := func(edit func(*corev1.Node)) *corev1.Node {
		res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2"), corev1.ResourceMemory: resource.MustParse("4Gi"),
			BridgePrefix + "br1": resource.MustParse("1")}
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: map[string]string{SchedulableLabel: "true", KVMLabel: "true", "zone": "a"}},
			Status: corev1.NodeStatus{Allocatable: res,
				Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}}
		if edit != nil {
			edit(n)
		}
		return n
	}
	taint := corev1.Taint{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}
	for _, tc := range []struct {
		name   string
		node   func(*corev1.Node)
		vmi    func(*kubevirtv1.VirtualMachineInstance)
		demand demand
		used   demand // already placed on the node
		noEmul bool
		// workloads is the KubeVirt CR's workloads placement.
		workloads *nodeplacement.Placement
		want      string // reasons joined by ", "; "" fits
	}{
		{name: "fits", demand: demand{cpu: 1000, mem: 1 << 30}},
		{name: "exactly full fits", demand: demand{cpu: 2000, mem: 4 << 30}},
		{name: "not labelled schedulable", node: func(n *corev1.Node) { delete(n.Labels, SchedulableLabel) }, want: "not schedulable"},
		{name: "cordoned", node: func(n *corev1.Node) { n.Spec.Unschedulable = true }, want: "not schedulable"},
		{name: "not ready", node: func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionUnknown }, want: "not ready"},
		{name: "untolerated taint", node: func(n *corev1.Node) { n.Spec.Taints = []corev1.Taint{taint} }, want: "untolerated taint {dedicated: db}"},
		{name: "tolerated taint", node: func(n *corev1.Node) { n.Spec.Taints = []corev1.Taint{taint} },
			vmi: func(v *kubevirtv1.VirtualMachineInstance) {
				v.Spec.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "db", Effect: corev1.TaintEffectNoSchedule}}
			}},
		{name: "prefer-no-schedule is no refusal", node: func(n *corev1.Node) {
			n.Spec.Taints = []corev1.Taint{{Key: "soft", Effect: corev1.TaintEffectPreferNoSchedule}}
		}},
		{name: "node selector", vmi: func(v *kubevirtv1.VirtualMachineInstance) { v.Spec.NodeSelector = map[string]string{"zone": "b"} },
			want: "didn't match node selector"},
		{name: "required node affinity", vmi: func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{
					{Key: "zone", Operator: corev1.NodeSelectorOpNotIn, Values: []string{"a"}}}}}}}}
		}, want: "didn't match node affinity"},
		{name: "cpu and memory together", demand: demand{cpu: 1500, mem: 3 << 30}, used: demand{cpu: 1000, mem: 2 << 30},
			want: "insufficient cpu, insufficient memory"},
		{name: "bridge lacking", node: func(n *corev1.Node) { delete(n.Status.Allocatable, BridgePrefix+"br1") },
			demand: demand{ext: map[corev1.ResourceName]int64{BridgePrefix + "br1": 1}}, want: "lacks bridge br1"},
		{name: "bridge used up", demand: demand{ext: map[corev1.ResourceName]int64{BridgePrefix + "br1": 1}},
			used: demand{ext: map[corev1.ResourceName]int64{BridgePrefix + "br1": 1}}, want: "insufficient bridge br1"},
		{name: "kvm required", node: func(n *corev1.Node) { delete(n.Labels, KVMLabel) }, noEmul: true, want: "lacks kvm"},
		{name: "kvm device is enough", node: func(n *corev1.Node) {
			delete(n.Labels, KVMLabel)
			n.Status.Allocatable[KVMResource] = resource.MustParse("1k")
		}, noEmul: true},
		{name: "emulation allowed", node: func(n *corev1.Node) { delete(n.Labels, KVMLabel) }},
		{name: "inside the workloads placement", workloads: &nodeplacement.Placement{NodeSelector: map[string]string{"zone": "a"},
			Field: workloadsField, DaemonLike: true}},
		{name: "outside the workloads placement's selector", workloads: &nodeplacement.Placement{NodeSelector: map[string]string{"zone": "b"},
			Field: workloadsField, DaemonLike: true}, want: "spec.workloads.nodePlacement.nodeSelector zone=b does not match"},
		{name: "outside the workloads placement's affinity", workloads: &nodeplacement.Placement{Affinity: &corev1.Affinity{
			NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{
					{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"b", "c"}}}}}}}},
			Field: workloadsField, DaemonLike: true}, want: "spec.workloads.nodePlacement.affinity does not match"},
		{name: "a taint the VMI tolerates but the workloads placement does not", node: func(n *corev1.Node) { n.Spec.Taints = []corev1.Taint{taint} },
			vmi: func(v *kubevirtv1.VirtualMachineInstance) {
				v.Spec.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists}}
			},
			workloads: &nodeplacement.Placement{NodeSelector: map[string]string{"zone": "a"}, Field: workloadsField, DaemonLike: true},
			want:      "taint dedicated:NoSchedule not tolerated by spec.workloads.nodePlacement.tolerations"},
		{name: "a taint the workloads placement tolerates but the VMI does not", node: func(n *corev1.Node) { n.Spec.Taints = []corev1.Taint{taint} },
			workloads: &nodeplacement.Placement{Tolerations: []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists}},
				Field: workloadsField, DaemonLike: true},
			want: "untolerated taint {dedicated: db}"},
		{name: "condition taints do not keep virt-handler off", node: func(n *corev1.Node) {
			n.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeDiskPressure, Effect: corev1.TaintEffectNoSchedule}}
		}, vmi: func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Tolerations = []corev1.Toleration{{Key: corev1.TaintNodeDiskPressure, Operator: corev1.TolerationOpExists}}
		}, workloads: &nodeplacement.Placement{NodeSelector: map[string]string{"zone": "a"}, Field: workloadsField, DaemonLike: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: "vms", Name: "v"}}
			if tc.vmi != nil {
				tc.vmi(vmi)
			}
			if tc.demand.ext == nil {
				tc.demand.ext = map[corev1.ResourceName]int64{}
			}
			st := newNodeState(node(tc.node))
			if tc.used.ext == nil {
				tc.used.ext = map[corev1.ResourceName]int64{}
			}
			st.add(placed{uid: "other", ns: "vms", demand: tc.used})
			req := &request{vmi: vmi, demand: tc.demand, allowEmul: !tc.noEmul, workloads: tc.workloads}
			if got := strings.Join(filter(req, st, []*nodeState{st}), ", "); got != tc.want {
				t.Errorf("filter = %q, want %q", got, tc.want)
			}
		})
	}
}
