package vmcontroller

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
)

// failure returns a condition func that holds when the VM is Stopped, has
// no VMI and its Failure condition carries reason.
func failure(reason string) func(*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) bool {
	return func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		if vmi != nil || vm.Status.PrintableStatus != kubevirtv1.VirtualMachineStatusStopped {
			return false
		}
		for _, c := range vm.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineFailure && c.Status == corev1.ConditionTrue && c.Reason == reason {
				return true
			}
		}
		return false
	}
}

// A VM naming an instance type or preference that does not exist yet
// reports it on a Failure condition, stays Stopped, and starts once the
// missing object is created, as KubeVirt's VM does.
func TestMissingInstancetypeAndPreference(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	itName := e.ns + "-later"
	e.newVM("waits", func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.Template.Spec.Domain.Memory = nil
		vm.Spec.Instancetype = &kubevirtv1.InstancetypeMatcher{Name: itName}
		vm.Spec.Preference = &kubevirtv1.PreferenceMatcher{Name: "later", Kind: "VirtualMachinePreference"}
	})
	vm, _ := e.waitVM("waits", "FailedFindInstancetype", failure("FailedFindInstancetype"))
	for _, c := range vm.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineFailure && c.Message == "" {
			t.Error("failure condition has no message")
		}
	}

	it := &instancetypev1beta1.VirtualMachineClusterInstancetype{ObjectMeta: metav1.ObjectMeta{Name: itName},
		Spec: instancetypev1beta1.VirtualMachineInstancetypeSpec{CPU: instancetypev1beta1.CPUInstancetype{Guest: 1},
			Memory: instancetypev1beta1.MemoryInstancetype{Guest: resource.MustParse("128Mi")}}}
	if _, err := e.virt.ClusterInstancetypes.Create(ctx, it); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.virt.ClusterInstancetypes.Delete(ctx, "", itName, metav1.DeleteOptions{}) })
	e.waitVM("waits", "FailedFindPreference", failure("FailedFindPreference"))

	pref := &instancetypev1beta1.VirtualMachinePreference{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "later"}}
	if _, err := e.virt.Preferences.Create(ctx, pref); err != nil {
		t.Fatal(err)
	}
	vm, vmi := e.waitVM("waits", "started once both exist", func(vm *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		for _, c := range vm.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineFailure {
				return false
			}
		}
		return v != nil
	})
	if vmi.Spec.Domain.Memory == nil || vmi.Spec.Domain.Memory.Guest.String() != "128Mi" {
		t.Errorf("vmi memory %+v, want the instance type's 128Mi", vmi.Spec.Domain.Memory)
	}
	if vm.Spec.Instancetype.RevisionName == "" || vm.Spec.Preference.RevisionName == "" {
		t.Errorf("revisions not recorded: %+v %+v", vm.Spec.Instancetype, vm.Spec.Preference)
	}
}
