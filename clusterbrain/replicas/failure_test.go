package replicas

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"
	poolv1beta1 "kubevirt.io/api/pool/v1beta1"

	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// guestWith is a template spec with a 128Mi guest and CPU model.
func guestWith(model string) kubevirtv1.VirtualMachineInstanceSpec {
	guest := resource.MustParse("128Mi")
	return kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Memory: &kubevirtv1.Memory{Guest: &guest},
		CPU: &kubevirtv1.CPU{Model: model}}}
}

// hasEvent checks that obj (named name, of kind) has an Event of type and
// reason whose message holds each of parts.
func (e *env) hasEvent(kind, name, typ, reason string, parts ...string) error {
	l, err := e.kube.CoreV1().Events(e.ns).List(e.ctx, metav1.ListOptions{FieldSelector: fields.Set{
		"involvedObject.kind": kind, "involvedObject.name": name, "reason": reason}.String()})
	if err != nil {
		return err
	}
	var seen []string
	for _, ev := range l.Items {
		seen = append(seen, ev.Type+" "+ev.Message)
		ok := ev.Type == typ
		for _, p := range parts {
			ok = ok && strings.Contains(ev.Message, p)
		}
		if ok {
			return nil
		}
	}
	return fmt.Errorf("no %s event %s on %s %s with %q (seen %q)", typ, reason, kind, name, parts, seen)
}

// TestRefusedMembersReported: a replica set whose template admission
// refuses (an obsolete CPU model, refused by the VMI webhook's own rules)
// makes no VMI and says so as KubeVirt's controller does: a FailedCreate
// Warning Event and a ReplicaFailure condition, reason FailedCreate, the
// refusal as message. Once its template is mended the VMIs are made
// (SuccessfulCreate Events) and the condition goes away. A pool whose VMs
// the API server refuses (a ValidatingAdmissionPolicy in the VM webhook's
// place) gets KubeVirt's pool reports: FailedCreate and FailedScaleOut
// Events and ReplicaFailure FailedScaleOut, removed once mended.
func TestRefusedMembersReported(t *testing.T) {
	e := start(t)
	two, labels := int32(2), map[string]string{"set": "refused"}
	rs := &kubevirtv1.VirtualMachineInstanceReplicaSet{ObjectMeta: metav1.ObjectMeta{Name: "refused", Namespace: e.ns},
		Spec: kubevirtv1.VirtualMachineInstanceReplicaSetSpec{Replicas: &two, Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: guestWith("486")}}}
	rs, err := e.virt.VMIReplicaSets.Create(e.ctx, rs)
	if err != nil {
		t.Fatal(err)
	}
	setFailure := func() *kubevirtv1.VirtualMachineInstanceReplicaSetCondition {
		t.Helper()
		cur, err := e.virt.VMIReplicaSets.Get(e.ctx, e.ns, rs.Name)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cur.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineInstanceReplicaSetReplicaFailure {
				return &c
			}
		}
		return nil
	}
	testkit.Eventually(t, time.Minute, "ReplicaFailure FailedCreate on the replica set", func() error {
		c := setFailure()
		if c == nil || c.Status != corev1.ConditionTrue || c.Reason != "FailedCreate" ||
			!strings.Contains(c.Message, `admission webhook "virtualmachineinstances-create-validator.kubevirt.io" denied the request`) ||
			!strings.Contains(c.Message, "spec.domain.cpu.model") {
			return fmt.Errorf("condition %+v", c)
		}
		return nil
	})
	testkit.Eventually(t, time.Minute, "the FailedCreate event", func() error {
		return e.hasEvent("VirtualMachineInstanceReplicaSet", rs.Name, corev1.EventTypeWarning, "FailedCreate",
			"Error creating virtual machine instance: ", "spec.domain.cpu.model")
	})
	if got := e.vmis(); len(got) != 0 {
		t.Fatalf("vmis %v made from a refused template", names(got))
	}

	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := e.virt.VMIReplicaSets.Get(e.ctx, e.ns, rs.Name)
		if err != nil {
			return err
		}
		cur.Spec.Template.Spec.Domain.CPU.Model = "Haswell-noTSX"
		_, err = e.virt.VMIReplicaSets.Update(e.ctx, cur)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, time.Minute, "two vmis and no ReplicaFailure", func() error {
		if got := e.vmis(); len(got) != 2 {
			return fmt.Errorf("vmis %v", names(got))
		}
		if c := setFailure(); c != nil {
			return fmt.Errorf("condition still there: %+v", c)
		}
		return e.hasEvent("VirtualMachineInstanceReplicaSet", rs.Name, corev1.EventTypeNormal, "SuccessfulCreate",
			"Started the virtual machine by creating the new virtual machine instance "+rs.Name)
	})

	e.refuseObsoleteVMs(t)
	one := int32(1)
	pool := &poolv1beta1.VirtualMachinePool{ObjectMeta: metav1.ObjectMeta{Name: "refused", Namespace: e.ns},
		Spec: poolv1beta1.VirtualMachinePoolSpec{Replicas: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "refused"}},
			VirtualMachineTemplate: &poolv1beta1.VirtualMachineTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"pool": "refused"}},
				Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: ptr(kubevirtv1.RunStrategyHalted),
					Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: guestWith("486")}}}}}
	if pool, err = e.virt.VMPools.Create(e.ctx, pool); err != nil {
		t.Fatal(err)
	}
	poolFailure := func() *poolv1beta1.VirtualMachinePoolCondition {
		t.Helper()
		cur, err := e.virt.VMPools.Get(e.ctx, e.ns, pool.Name)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cur.Status.Conditions {
			if c.Type == poolv1beta1.VirtualMachinePoolReplicaFailure {
				return &c
			}
		}
		return nil
	}
	testkit.Eventually(t, time.Minute, "ReplicaFailure FailedScaleOut on the pool, and its events", func() error {
		c := poolFailure()
		if c == nil || c.Status != corev1.ConditionTrue || c.Reason != "FailedScaleOut" ||
			!strings.HasPrefix(c.Message, "error during scale out: ") || !strings.Contains(c.Message, "486 is obsolete") {
			return fmt.Errorf("condition %+v", c)
		}
		if err := e.hasEvent("VirtualMachinePool", pool.Name, corev1.EventTypeWarning, "FailedCreate", "Error creating VM: ", "486 is obsolete"); err != nil {
			return err
		}
		return e.hasEvent("VirtualMachinePool", pool.Name, corev1.EventTypeWarning, "FailedScaleOut", "error during scale out: ")
	})
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := e.virt.VMPools.Get(e.ctx, e.ns, pool.Name)
		if err != nil {
			return err
		}
		cur.Spec.VirtualMachineTemplate.Spec.Template.Spec.Domain.CPU.Model = "Haswell-noTSX"
		_, err = e.virt.VMPools.Update(e.ctx, cur)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, time.Minute, "the pool's VM and no ReplicaFailure", func() error {
		if _, err := e.virt.VMs.Get(e.ctx, e.ns, "refused-0"); err != nil {
			return err
		}
		if c := poolFailure(); c != nil {
			return fmt.Errorf("condition still there: %+v", c)
		}
		return e.hasEvent("VirtualMachinePool", pool.Name, corev1.EventTypeNormal, "SuccessfulCreate", "Created VM "+e.ns+"/refused-0")
	})
}

// refuseObsoleteVMs makes the API server refuse VMs of the test's
// namespace whose template names the CPU model 486, as the VM webhook
// refuses obsolete models, and waits until the policy is in force.
func (e *env) refuseObsoleteVMs(t *testing.T) {
	t.Helper()
	name := "refuse-obsolete-" + e.ns
	fail := admissionregistrationv1.Fail
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{FailurePolicy: &fail,
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
					Rule: admissionregistrationv1.Rule{APIGroups: []string{"kubevirt.io"}, APIVersions: []string{"*"}, Resources: []string{"virtualmachines"}}}}}},
			Validations: []admissionregistrationv1.Validation{{
				Expression: "!has(object.spec.template.spec.domain.cpu) || !has(object.spec.template.spec.domain.cpu.model) || object.spec.template.spec.domain.cpu.model != '486'",
				Message:    "spec.template.spec.domain.cpu.model: 486 is obsolete"}}}}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: name,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny},
			MatchResources: &admissionregistrationv1.MatchResources{NamespaceSelector: &metav1.LabelSelector{
				MatchLabels: map[string]string{corev1.LabelMetadataName: e.ns}}}}}
	adm := e.kube.AdmissionregistrationV1()
	if _, err := adm.ValidatingAdmissionPolicies().Create(e.ctx, policy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = adm.ValidatingAdmissionPolicies().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	if _, err := adm.ValidatingAdmissionPolicyBindings().Create(e.ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = adm.ValidatingAdmissionPolicyBindings().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	dyn, err := dynamic.NewForConfig(controlplane.Shared(t).RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	probe := &kubevirtv1.VirtualMachine{TypeMeta: metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachine"},
		ObjectMeta: metav1.ObjectMeta{Name: "probe", Namespace: e.ns},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: ptr(kubevirtv1.RunStrategyHalted),
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: guestWith("486")}}}
	raw, err := runtime.DefaultUnstructuredConverter.ToUnstructured(probe)
	if err != nil {
		t.Fatal(err)
	}
	vms := dyn.Resource(kubevirtv1.GroupVersion.WithResource("virtualmachines")).Namespace(e.ns)
	testkit.Eventually(t, time.Minute, "the policy refusing a VM naming 486", func() error {
		_, err := vms.Create(e.ctx, &unstructured.Unstructured{Object: raw}, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err == nil || !strings.Contains(err.Error(), "486 is obsolete") {
			return fmt.Errorf("dry-run create: %v", err)
		}
		return nil
	})
}
