package e2e

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestInvalidSpecsRefused: specs KubeVirt refuses are refused at creation,
// with a message naming the offending field; nothing is created.
func TestInvalidSpecsRefused(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	disk := n.e.path("disks", n.name, "never-booted.raw") // no guest runs: the file need not exist
	vmiCases := []struct {
		name   string
		field  string
		mutate func(*kubevirtv1.VirtualMachineInstanceSpec)
	}{
		{"disk-without-volume", "spec.domain.devices.disks[1].name", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Devices.Disks = append(s.Domain.Devices.Disks, kubevirtv1.Disk{Name: "ghost"})
		}},
		{"interface-without-network", "spec.domain.devices.interfaces[0].name", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Devices.Interfaces = []kubevirtv1.Interface{{Name: "nowhere",
				InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Bridge: &kubevirtv1.InterfaceBridge{}}}}
		}},
		{"bad-mac", "spec.domain.devices.interfaces[0].macAddress", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			withBridge("somewhere")(s)
			s.Domain.Devices.Interfaces[0].MacAddress = "02:00:00:zz:00:01"
		}},
		{"no-memory", "spec.domain.resources.requests.memory", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Resources.Requests = nil
		}},
		{"limit-below-request", "spec.domain.resources.limits.memory", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}
		}},
		{"duplicate-volume", "spec.volumes[1].name", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Volumes = append(s.Volumes, s.Volumes[0])
		}},
	}
	for _, tc := range vmiCases {
		t.Run("vmi/"+tc.name, func(t *testing.T) {
			spec := vmiSpec(disk)
			tc.mutate(&spec)
			vmi := &kubevirtv1.VirtualMachineInstance{}
			vmi.Name, vmi.Namespace, vmi.Spec = "invalid-"+tc.name, n.name, spec
			_, err := e.virt.VMIs.Create(context.Background(), vmi)
			checkRefused(t, err, tc.field)
			if _, gerr := e.virt.VMIs.Get(context.Background(), n.name, vmi.Name); !apierrors.IsNotFound(gerr) {
				t.Errorf("the refused VMI exists anyway (%v)", gerr)
			}
		})
	}
	t.Run("vm/bad-run-strategy", func(t *testing.T) {
		spec := vmiSpec(disk)
		rs := kubevirtv1.VirtualMachineRunStrategy("Sometimes")
		vm := &kubevirtv1.VirtualMachine{Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &rs,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: spec}}}
		vm.Name, vm.Namespace = "invalid-run-strategy", n.name
		_, err := e.virt.VMs.Create(context.Background(), vm)
		checkRefused(t, err, "spec.runStrategy")
	})
	t.Run("vm/invalid-template", func(t *testing.T) {
		spec := vmiSpec(disk)
		spec.Domain.Devices.Disks = append(spec.Domain.Devices.Disks, kubevirtv1.Disk{Name: "ghost"})
		rs := kubevirtv1.RunStrategyHalted
		vm := &kubevirtv1.VirtualMachine{Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &rs,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: spec}}}
		vm.Name, vm.Namespace = "invalid-template", n.name
		_, err := e.virt.VMs.Create(context.Background(), vm)
		checkRefused(t, err, "spec.template.spec.domain.devices.disks[1].name")
	})
}

// checkRefused asserts that err is the API's refusal naming field.
func checkRefused(t *testing.T, err error, field string) {
	t.Helper()
	if err == nil {
		t.Fatalf("accepted; want a refusal naming %s (the VM/VMI validating webhooks of clusterbrain/admission are not installed?)", field)
	}
	if !apierrors.IsInvalid(err) && !apierrors.IsBadRequest(err) && !apierrors.IsForbidden(err) {
		t.Errorf("refused with %v, want Invalid/BadRequest/Forbidden", err)
	}
	msg := err.Error()
	if st, ok := err.(apierrors.APIStatus); ok && st.Status().Details != nil {
		for _, c := range st.Status().Details.Causes {
			msg += " " + c.Field + ": " + c.Message
		}
	}
	if !strings.Contains(msg, field) {
		t.Errorf("refusal does not name %s: %s", field, msg)
	}
}
