package admission

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestMemoryOvercommitThroughTheAPIServer: with the KubeVirt CR's
// memoryOvercommit at 150, a VMI created through the API server that gives
// only its guest memory gets the request guest × 100 / 150 from the
// mutating webhook; a VMI's own request, and one with only a limit, are
// kept as KubeVirt keeps them. The CR's default CPU model is given too, and
// the maxSockets of its liveUpdateConfiguration (LiveUpdate, the default
// rollout strategy).
func TestMemoryOvercommitThroughTheAPIServer(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	kv := &kubevirtv1.KubeVirt{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "kubevirt"}}
	kv.Spec.Configuration.DeveloperConfiguration = &kubevirtv1.DeveloperConfiguration{MemoryOvercommit: 150}
	kv.Spec.Configuration.CPUModel = "Haswell-noTSX"
	six := uint32(6)
	kv.Spec.Configuration.LiveUpdateConfiguration = &kubevirtv1.LiveUpdateConfiguration{MaxCpuSockets: &six}
	if _, err := e.virt.KubeVirts.Create(ctx, kv); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.virt.KubeVirts.Delete(context.Background(), e.ns, kv.Name, metav1.DeleteOptions{}) })
	serve(t, e, certs.Config{})

	create := func(name string, edit func(*kubevirtv1.VirtualMachineInstanceSpec)) *kubevirtv1.VirtualMachineInstance {
		t.Helper()
		spec := vmWith(e.ns, name, func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			g := resource.MustParse("3Gi")
			s.Domain.Memory.Guest = &g
			if edit != nil {
				edit(s)
			}
		}).Spec.Template.Spec
		got, err := e.virt.VMIs.Create(ctx, &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: spec})
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	memory := func(v *kubevirtv1.VirtualMachineInstance) (guest, req string) {
		r := v.Spec.Domain.Resources.Requests[corev1.ResourceMemory]
		if v.Spec.Domain.Memory != nil && v.Spec.Domain.Memory.Guest != nil {
			guest = v.Spec.Domain.Memory.Guest.String()
		}
		return guest, r.String()
	}

	// The webhook reads the CR from an informer, synced within seconds
	// (more on a loaded machine): the first VMIs may predate it.
	n := 0
	testkit.Eventually(t, time.Minute, "a guest-only VMI requesting 2Gi of its 3Gi", func() error {
		n++
		v := create(fmt.Sprintf("dense-%d", n), nil)
		if g, r := memory(v); g != "3Gi" || r != "2Gi" {
			return fmt.Errorf("guest only: guest %s request %s, want 3Gi and 2Gi", g, r)
		}
		if v.Spec.Domain.CPU == nil || v.Spec.Domain.CPU.Model != "Haswell-noTSX" || v.Spec.Domain.CPU.MaxSockets != 6 {
			return fmt.Errorf("cpu %+v, want the default model and maxSockets 6", v.Spec.Domain.CPU)
		}
		return nil
	})
	if g, r := memory(create("own-request", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("3Gi")}
	})); g != "3Gi" || r != "3Gi" {
		t.Errorf("own request: guest %s request %s, want 3Gi and 3Gi", g, r)
	}
	if g, r := memory(create("limit-only", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.Domain.Memory = nil
		s.Domain.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("3Gi")}
	})); g != "3Gi" || r != "3Gi" {
		t.Errorf("limit only: guest %s request %s, want 3Gi and 3Gi", g, r)
	}
}
