package vmcontroller

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestBrainAdmitsItsOwnVMIs: the VMI webhooks are not called for the
// brain's user, whose controller applies them in process. A VM whose VMI
// they refuse (created before the webhooks existed) fails with the
// message the webhook gives another user for the same VMI; a valid VM's
// VMI is what it was when the webhooks were called for it.
func TestBrainAdmitsItsOwnVMIs(t *testing.T) {
	ctx := context.Background()
	cp := controlplane.Shared(t)
	e := newEnv(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// Created while no webhook is registered: one VM whose template lists
	// its disk twice, one whose memory is a limit alone (the limit becomes
	// the guest size and the request).
	dupDisk := func(vm *kubevirtv1.VirtualMachine) {
		d := &vm.Spec.Template.Spec.Domain.Devices
		d.Disks = append(d.Disks, kubevirtv1.Disk{Name: "root"})
	}
	limitOnly := func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.RunStrategy = strategy(kubevirtv1.RunStrategyManual)
		d := &vm.Spec.Template.Spec.Domain
		d.Memory = nil
		d.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("96Mi")}
	}
	bad := e.newVM("refused", dupDisk)
	limited := e.newVM("limited", limitOnly)

	adm, err := admission.NewRole(admission.Config{Addr: "127.0.0.1:0", Namespace: e.ns},
		admission.Deps{Kube: e.kube, Virt: e.virt, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	admCtx, admStop := context.WithCancel(ctx)
	admDone := make(chan error, 1)
	go func() { admDone <- adm.Run(admCtx) }()
	t.Cleanup(func() {
		_ = admission.Uninstall(context.Background(), e.kube, e.ns)
		admStop()
		<-admDone
	})

	// Another user (the test's administrator) is still refused by the
	// validating webhook for the VMI the refused VM would make.
	probe := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "refused"},
		Spec: *bad.Spec.Template.Spec.DeepCopy()}
	admission.DefaultVMISpec(&probe.Spec)
	var webhookErr error
	testkit.PollEvery(t, 100*time.Millisecond, 30*time.Second, "the validating webhook to refuse another user's invalid vmi", func() (bool, error) {
		_, webhookErr = e.virt.VMIs.Create(ctx, probe.DeepCopy())
		if webhookErr == nil {
			_ = e.virt.VMIs.Delete(ctx, e.ns, probe.Name, metav1.DeleteOptions{})
		}
		return webhookErr != nil && strings.Contains(webhookErr.Error(), "denied the request"), fmt.Errorf("last: %v", webhookErr)
	})
	if !strings.Contains(webhookErr.Error(), `admission webhook "`+admission.VMIValidatorName+`"`) ||
		!strings.Contains(webhookErr.Error(), `spec.domain.devices.disks[1].name: Duplicate value: "root"`) {
		t.Fatalf("another user's refusal: %v", webhookErr)
	}
	if !apierrors.IsInvalid(webhookErr) {
		t.Errorf("another user's refusal is not Invalid: %#v", webhookErr)
	}
	// The same user's defaulted limit-only VMI, through both webhooks: what
	// the controller must create for the limited VM.
	want := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "limited-by-webhook"},
		Spec: *limited.Spec.Template.Spec.DeepCopy()}
	admission.DefaultVMISpec(&want.Spec)
	if want, err = e.virt.VMIs.Create(ctx, want); err != nil {
		t.Fatal(err)
	}

	// The brain's user is not sent to the webhooks at all.
	cfgPath := filepath.Join(t.TempDir(), "clusterbrain.kubeconfig")
	if err := rbac.EnsureDaemons(ctx, e.kube); err != nil {
		t.Fatal(err)
	}
	if err := cp.WriteKubeconfig(cfgPath, identity.BrainUser, identity.BrainGroup); err != nil {
		t.Fatal(err)
	}
	brainRC, err := clientcmd.BuildConfigFromFlags("", cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	brainVirt, err := client.NewSet(brainRC)
	if err != nil {
		t.Fatal(err)
	}
	bypass := probe.DeepCopy()
	bypass.Name = "not-sent-to-webhooks"
	if _, err := brainVirt.VMIs.Create(ctx, bypass); err != nil {
		t.Fatalf("the brain's own vmi create went to the webhooks: %v", err)
	}
	_ = e.virt.VMIs.Delete(ctx, e.ns, bypass.Name, metav1.DeleteOptions{})

	c, err := New(Config{RestConfig: brainRC, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	ctrlCtx, ctrlStop := context.WithCancel(ctx)
	ctrlDone := make(chan struct{})
	go func() { defer close(ctrlDone); _ = c.Run(ctrlCtx) }()
	t.Cleanup(func() { ctrlStop(); <-ctrlDone })

	wantMsg := "create vmi: " + webhookErr.Error()
	vm, _ := e.waitVM("refused", "the refusal reported", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		for _, cnd := range vm.Status.Conditions {
			if cnd.Type == kubevirtv1.VirtualMachineFailure && cnd.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	for _, cnd := range vm.Status.Conditions {
		if cnd.Type == kubevirtv1.VirtualMachineFailure && (cnd.Reason != "FailedCreate" || cnd.Message != wantMsg) {
			t.Errorf("failure condition %s %q, want FailedCreate %q", cnd.Reason, cnd.Message, wantMsg)
		}
	}
	if _, err := e.virt.VMIs.Get(ctx, e.ns, "refused"); !apierrors.IsNotFound(err) {
		t.Errorf("the refused vmi exists (%v)", err)
	}
	wantEvent := "Error creating VMI: " + webhookErr.Error()
	var seen []string
	err = testkit.Wait(100*time.Millisecond, 15*time.Second, "a FailedCreate event", func() (bool, error) {
		evs, err := e.kube.CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=refused"})
		if err != nil {
			return false, nil
		}
		seen = seen[:0]
		for _, ev := range evs.Items {
			seen = append(seen, ev.Reason+": "+ev.Message)
			if ev.Type == corev1.EventTypeWarning && ev.Reason == "FailedCreate" && ev.Message == wantEvent {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Errorf("no FailedCreate event %q; events: %q", wantEvent, seen)
	}

	e.request("limited", kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StartRequest})
	_, got := e.waitVM("limited", "its vmi", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil
	})
	if !equality.Semantic.DeepEqual(got.Spec, want.Spec) {
		t.Errorf("the controller's vmi differs from the webhooks' one:\n got %+v\nwant %+v", got.Spec, want.Spec)
	}
	if q := got.Spec.Domain.Resources.Requests.Memory(); q.String() != "96Mi" {
		t.Errorf("memory request %s, want 96Mi (the mutating webhook's second default)", q)
	}
}
