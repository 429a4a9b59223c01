package vmsnapshot

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/vmclone"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestAdmission: the snapshot, restore and clone validators refuse what
// KubeVirt's do and admit the rest.
func TestAdmission(t *testing.T) {
	e := Start(t)
	s, err := admission.New(admission.Config{Addr: "127.0.0.1:0", Namespace: e.NS},
		admission.Deps{Kube: e.Kube, Virt: e.Virt, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []admission.Contributor{Webhooks(), vmclone.Webhooks()} {
		if err := c(s); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() { _ = admission.Uninstall(context.Background(), e.Kube, e.NS); cancel(); <-done })
	<-s.Ready()

	e.Claim("d")
	vm := e.VM("src", "d")
	vm.Spec.Template.Spec.Domain.Devices.Interfaces = []kubevirtv1.Interface{{Name: "default"}}
	if _, err := e.Virt.VMs.Update(e.Ctx, vm); err != nil {
		t.Fatal(err)
	}
	group, podGroup := kubevirtv1.GroupVersion.Group, ""
	// The webhooks are published asynchronously: the first refusal is
	// waited for.
	badKind := func() error {
		_, err := e.Virt.VMSnapshots.Create(e.Ctx, &snapv1beta1.VirtualMachineSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, GenerateName: "bad-"},
			Spec: snapv1beta1.VirtualMachineSnapshotSpec{Source: corev1.TypedLocalObjectReference{APIGroup: &podGroup, Kind: "Pod", Name: "p"}}})
		return err
	}
	testkit.Until(t, 30*time.Second, "snapshot of a Pod refused", func() bool {
		err := badKind()
		return err != nil && strings.Contains(err.Error(), "invalid kind")
	})

	for _, tc := range []struct {
		what, want string
		create     func() error
	}{
		{"restore of a missing snapshot", "does not exist", func() error {
			_, err := e.Virt.VMRestores.Create(e.Ctx, &snapv1beta1.VirtualMachineRestore{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "r1"},
				Spec: snapv1beta1.VirtualMachineRestoreSpec{VirtualMachineSnapshotName: "nope",
					Target: corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachine", Name: "src"}}})
			return err
		}},
		{"clone onto its source", "target name cannot be equal to source name", func() error {
			_, err := e.Virt.VMClones.Create(e.Ctx, &clonev1beta1.VirtualMachineClone{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "c1"},
				Spec: clonev1beta1.VirtualMachineCloneSpec{Source: ref("VirtualMachine", "src"), Target: ref("VirtualMachine", "src")}})
			return err
		}},
		{"clone with a MAC for a missing interface", "interface eth9 does not exist", func() error {
			_, err := e.Virt.VMClones.Create(e.Ctx, &clonev1beta1.VirtualMachineClone{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "c2"},
				Spec: clonev1beta1.VirtualMachineCloneSpec{Source: ref("VirtualMachine", "src"), NewMacAddresses: map[string]string{"eth9": "02:00:00:00:00:09"}}})
			return err
		}},
		{"clone of a missing VM", "does not exist", func() error {
			_, err := e.Virt.VMClones.Create(e.Ctx, &clonev1beta1.VirtualMachineClone{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "c3"},
				Spec: clonev1beta1.VirtualMachineCloneSpec{Source: ref("VirtualMachine", "ghost")}})
			return err
		}},
	} {
		if err := tc.create(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want a refusal saying %q", tc.what, err, tc.want)
		}
	}

	e.snapshot("ok", "src")
	// The controller writes the snapshot meanwhile: conflicts are retried.
	var updateErr error
	testkit.Until(t, 30*time.Second, "snapshot spec change answered", func() bool {
		s1, err := e.Virt.VMSnapshots.Get(e.Ctx, e.NS, "ok")
		if err != nil {
			t.Fatal(err)
		}
		s1.Spec.Source.Name = "other"
		_, updateErr = e.Virt.VMSnapshots.Update(e.Ctx, s1)
		return !apierrors.IsConflict(updateErr)
	})
	if updateErr == nil || !strings.Contains(updateErr.Error(), "immutable") {
		t.Errorf("snapshot spec change: %v, want refused as immutable", updateErr)
	}
	if _, err := e.Virt.VMClones.Create(e.Ctx, &clonev1beta1.VirtualMachineClone{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "fine"},
		Spec: clonev1beta1.VirtualMachineCloneSpec{Source: ref("VirtualMachine", "src"), NewMacAddresses: map[string]string{"default": "02:00:00:00:00:01"}}}); err != nil {
		t.Errorf("a valid clone was refused: %v", err)
	}
}
