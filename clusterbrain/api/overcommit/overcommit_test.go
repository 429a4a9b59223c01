package overcommit

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestApply(t *testing.T) {
	q := func(s string) *resource.Quantity { v := resource.MustParse(s); return &v }
	for _, tc := range []struct {
		name    string
		percent Memory
		guest   *resource.Quantity
		req     *resource.Quantity // the VMI's own request
		limit   *resource.Quantity
		want    string // the request after Apply; "" none
		changed bool
	}{
		{name: "150 percent", percent: 150, guest: q("3Gi"), want: "2Gi", changed: true},
		{name: "200 percent", percent: 200, guest: q("1Gi"), want: "512Mi", changed: true},
		{name: "rounds down to the byte", percent: 300, guest: q("1Gi"), want: "357913941", changed: true},
		{name: "default: the guest's size", percent: Default, guest: q("1Gi"), want: "1Gi", changed: true},
		{name: "the VMI's own request", percent: 150, guest: q("3Gi"), req: q("3Gi"), want: "3Gi"},
		{name: "only a limit", percent: 150, limit: q("3Gi")},
		{name: "nothing", percent: 150},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var spec kubevirtv1.VirtualMachineInstanceSpec
			if tc.guest != nil {
				spec.Domain.Memory = &kubevirtv1.Memory{Guest: tc.guest}
			}
			if tc.req != nil {
				spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: *tc.req}
			}
			if tc.limit != nil {
				spec.Domain.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: *tc.limit}
			}
			changed := tc.percent.Apply(&spec)
			got := ""
			if r, ok := spec.Domain.Resources.Requests[corev1.ResourceMemory]; ok {
				got = r.String()
			}
			if got != tc.want || changed != tc.changed {
				t.Errorf("request %q changed %v, want %q %v", got, changed, tc.want, tc.changed)
			}
			if tc.guest != nil && spec.Domain.Memory.Guest.Cmp(*tc.guest) != 0 {
				t.Errorf("guest memory changed to %s", spec.Domain.Memory.Guest)
			}
		})
	}
}

func TestFromKubeVirt(t *testing.T) {
	kv := &kubevirtv1.KubeVirt{}
	if got := FromKubeVirt(nil); got != Default {
		t.Errorf("no CR: %d", got)
	}
	if got := FromKubeVirt(kv); got != Default {
		t.Errorf("no developerConfiguration: %d", got)
	}
	kv.Spec.Configuration.DeveloperConfiguration = &kubevirtv1.DeveloperConfiguration{MemoryOvercommit: 150}
	if got := FromKubeVirt(kv); got != 150 {
		t.Errorf("150: %d", got)
	}
	// The zero Memory (an unset live.Value) is Default.
	var unset Memory
	if unset.Request(1<<30) != 1<<30 || Memory(150).Request(3<<20) != 2<<20 {
		t.Errorf("requests: unset %d, 150%% of 3Mi %d", unset.Request(1<<30), Memory(150).Request(3<<20))
	}
}
