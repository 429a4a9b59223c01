package replicas

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	poolv1beta1 "kubevirt.io/api/pool/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/vmcontroller"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestMembersGetTheKubeVirtCRsDefaults: a replica set's VMIs, which the
// brain creates past its own webhooks, get what the KubeVirt CR in force
// says, as VMs' VMIs do (the brain feeds both from the same holders): the
// default CPU model and the overcommitted memory request of a guest-only
// template; a template naming an obsolete model makes no VMI. A pool's VMs
// get theirs from the VM controller.
func TestMembersGetTheKubeVirtCRsDefaults(t *testing.T) {
	cpu, mem := &live.Value[cpumodel.Cluster]{}, &live.Value[overcommit.Memory]{}
	cpu.Set(cpumodel.FromKubeVirt(&kubevirtv1.KubeVirt{Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
		CPUModel: "Haswell-noTSX"}}}))
	mem.Set(200)
	e := start(t, func(c *Config) { c.CPUModels, c.MemoryOvercommit = cpu, mem })
	vmc, err := vmcontroller.New(vmcontroller.Config{RestConfig: controlplane.Shared(t).RestConfig, CPUModels: cpu, MemoryOvercommit: mem,
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = vmc.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	spec := func(model string) kubevirtv1.VirtualMachineInstanceSpec {
		guest := resource.MustParse("128Mi")
		s := kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Memory: &kubevirtv1.Memory{Guest: &guest}}}
		if model != "" {
			s.Domain.CPU = &kubevirtv1.CPU{Model: model}
		}
		return s
	}
	set := func(name, model string) {
		t.Helper()
		two, labels := int32(2), map[string]string{"set": name}
		rs := &kubevirtv1.VirtualMachineInstanceReplicaSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
			Spec: kubevirtv1.VirtualMachineInstanceReplicaSetSpec{Replicas: &two, Selector: &metav1.LabelSelector{MatchLabels: labels},
				Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: spec(model)}}}
		if _, err := e.virt.VMIReplicaSets.Create(e.ctx, rs); err != nil {
			t.Fatal(err)
		}
	}
	set("old", "486")
	set("dense", "")
	// wants checks a member VMI's model and memory request.
	wants := func(vmi *kubevirtv1.VirtualMachineInstance) error {
		req := vmi.Spec.Domain.Resources.Requests[corev1.ResourceMemory]
		if vmi.Spec.Domain.CPU == nil || vmi.Spec.Domain.CPU.Model != "Haswell-noTSX" || req.String() != "64Mi" ||
			vmi.Spec.Domain.Memory.Guest.String() != "128Mi" {
			return fmt.Errorf("vmi %s: cpu %+v, memory request %s guest %s; want the default model and 64Mi (128Mi at 200%%)",
				vmi.Name, vmi.Spec.Domain.CPU, req.String(), vmi.Spec.Domain.Memory.Guest)
		}
		return nil
	}
	testkit.Eventually(t, 60*time.Second, "the replica set's two VMIs, defaulted", func() error {
		var n int
		for _, vmi := range e.vmis() {
			if vmi.Labels["set"] != "dense" {
				continue
			}
			if err := wants(vmi); err != nil {
				return err
			}
			n++
		}
		if n != 2 {
			return fmt.Errorf("%d vmis", n)
		}
		return nil
	})
	for _, vmi := range e.vmis() {
		if vmi.Labels["set"] == "old" {
			t.Errorf("vmi %s made from a template naming an obsolete model", vmi.Name)
		}
	}

	one := int32(1)
	pool := &poolv1beta1.VirtualMachinePool{ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec: poolv1beta1.VirtualMachinePoolSpec{Replicas: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "p"}},
			VirtualMachineTemplate: &poolv1beta1.VirtualMachineTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"pool": "p"}},
				Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: ptr(kubevirtv1.RunStrategyAlways),
					Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: spec("")}}}}}
	if _, err := e.virt.VMPools.Create(e.ctx, pool); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 60*time.Second, "the pool VM's VMI, defaulted", func() error {
		vmi, err := e.virt.VMIs.Get(e.ctx, e.ns, "pool-0")
		if err != nil {
			return err
		}
		return wants(vmi)
	})
}

func ptr[T any](v T) *T { return &v }
