package subresources

import (
	"context"
	"net/http"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"

	"github.com/nodevirt/nodevirt/test/controlplane"
)

// TestExpandSpecFollowsTheVMControllerRule: expand-spec answers what the
// VM controller starts (the same instance type and preference as
// vmcontroller's TestInstancetypeExpansion give its VMI 1 socket of 2
// cores, 1Gi and SATA disks), preferences included, and refuses what the
// controller refuses.
func TestExpandSpecFollowsTheVMControllerRule(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)
	itName := ns + "-small"
	it := &instancetypev1beta1.VirtualMachineClusterInstancetype{ObjectMeta: metav1.ObjectMeta{Name: itName},
		Spec: instancetypev1beta1.VirtualMachineInstancetypeSpec{CPU: instancetypev1beta1.CPUInstancetype{Guest: 2},
			Memory: instancetypev1beta1.MemoryInstancetype{Guest: resource.MustParse("1Gi")}}}
	if _, err := env.virt.ClusterInstancetypes.Create(ctx, it); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.virt.ClusterInstancetypes.Delete(ctx, "", itName, metav1.DeleteOptions{}) })
	cores := instancetypev1beta1.Cores
	pref := &instancetypev1beta1.VirtualMachinePreference{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "sata"},
		Spec: instancetypev1beta1.VirtualMachinePreferenceSpec{
			CPU:     &instancetypev1beta1.CPUPreferences{PreferredCPUTopology: &cores},
			Devices: &instancetypev1beta1.DevicePreferences{PreferredDiskBus: kubevirtv1.DiskBusSATA}}}
	if _, err := env.virt.Preferences.Create(ctx, pref); err != nil {
		t.Fatal(err)
	}
	typedVM := func(name string, requests corev1.ResourceList) {
		t.Helper()
		halted := kubevirtv1.RunStrategyHalted
		vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &halted,
				Instancetype: &kubevirtv1.InstancetypeMatcher{Name: itName},
				Preference:   &kubevirtv1.PreferenceMatcher{Name: "sata", Kind: "VirtualMachinePreference"},
				Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: kubevirtv1.VirtualMachineInstanceSpec{
					Domain: kubevirtv1.DomainSpec{Resources: kubevirtv1.ResourceRequirements{Requests: requests},
						Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{Name: "root"}}}}}}}}
		if _, err := env.virt.VMs.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("expanded like the controller's vmi", func(t *testing.T) {
		typedVM("typed", nil)
		var vm kubevirtv1.VirtualMachine
		if err := c.ExpandSpec(ctx, "typed", &vm); err != nil {
			t.Fatal(err)
		}
		d := vm.Spec.Template.Spec.Domain
		if d.CPU == nil || d.CPU.Sockets != 1 || d.CPU.Cores != 2 || d.CPU.Threads != 1 || d.Memory == nil || d.Memory.Guest.String() != "1Gi" {
			t.Errorf("instancetype not applied: cpu %+v memory %+v", d.CPU, d.Memory)
		}
		if disk := d.Devices.Disks[0].Disk; disk == nil || disk.Bus != kubevirtv1.DiskBusSATA {
			t.Errorf("preference not applied: %+v", d.Devices.Disks[0])
		}
		if vm.Spec.Instancetype != nil || vm.Spec.Preference != nil {
			t.Errorf("references kept: %+v %+v", vm.Spec.Instancetype, vm.Spec.Preference)
		}
	})
	t.Run("template conflicts refused", func(t *testing.T) {
		typedVM("conflict", corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("128Mi")})
		var vm kubevirtv1.VirtualMachine
		wantStatus(t, "expand-spec of a conflicting vm", c.ExpandSpec(ctx, "conflict", &vm), http.StatusConflict,
			"VM field spec.template.spec.domain.resources.requests.memory conflicts with selected instance type")
	})
	t.Run("missing preference", func(t *testing.T) {
		halted := kubevirtv1.RunStrategyHalted
		vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: "nopref", Namespace: ns},
			Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &halted,
				Preference: &kubevirtv1.PreferenceMatcher{Name: "nope", Kind: "VirtualMachinePreference"},
				Template:   &kubevirtv1.VirtualMachineInstanceTemplateSpec{}}}
		if _, err := env.virt.VMs.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		wantStatus(t, "expand-spec with a missing preference", c.ExpandSpec(ctx, "nopref", vm), http.StatusNotFound, "nope")
	})
}
