package admission

import (
	"context"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
)

// A VM naming an instance type that does not exist yet is admitted, as
// KubeVirt admits it, even with fields a type would own; once the type
// exists, those fields are refused as conflicts.
func TestMissingInstancetypeAdmitted(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()
	itName := e.ns + "-absent"
	typed := func(name, kind string) *kubevirtv1.VirtualMachine {
		vm := vmWith(e.ns, name, nil) // sets memory.guest, which a type owns
		vm.Spec.Instancetype = &kubevirtv1.InstancetypeMatcher{Name: itName, Kind: kind}
		return vm
	}
	for _, kind := range []string{"", "VirtualMachineInstancetype"} {
		if _, err := e.virt.VMs.Create(ctx, typed("missing"+strings.ToLower(kind), kind)); err != nil {
			t.Errorf("vm naming a missing %q instance type refused: %v", kind, err)
		}
	}

	it := &instancetypev1beta1.VirtualMachineClusterInstancetype{ObjectMeta: metav1.ObjectMeta{Name: itName},
		Spec: instancetypev1beta1.VirtualMachineInstancetypeSpec{CPU: instancetypev1beta1.CPUInstancetype{Guest: 1},
			Memory: instancetypev1beta1.MemoryInstancetype{Guest: resource.MustParse("128Mi")}}}
	if _, err := e.virt.ClusterInstancetypes.Create(ctx, it); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.virt.ClusterInstancetypes.Delete(ctx, "", itName, metav1.DeleteOptions{}) })
	_, err := e.virt.VMs.Create(ctx, typed("conflicting", ""))
	const want = "spec.template.spec.domain.memory.guest: Invalid value: \"64Mi\": VM field conflicts with selected instance type"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("vm conflicting with an existing instance type: got %v, want %q", err, want)
	}
}
