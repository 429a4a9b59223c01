package vmsnapshot

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/vmclone"
	"github.com/nodevirt/nodevirt/test/testkit"
	"github.com/nodevirt/nodevirt/test/upstreamvirtctl"
)

// startClones runs the clone controller beside e's.
func startClones(e *Env) {
	e.T.Helper()
	c, err := vmclone.New(vmclone.Config{Virt: e.Virt, Log: quiet()})
	if err != nil {
		e.T.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.Ctx)
	var wg sync.WaitGroup
	wg.Go(func() { _ = c.Run(ctx) })
	e.T.Cleanup(func() { cancel(); wg.Wait() })
}

// TestCloneFromVirtctlManifest: the manifest upstream `virtctl create
// clone` prints applies as it is; the clone goes through its phases to
// Succeeded; the target VM has the filtered labels and annotations, the
// requested MAC, the requested SMBIOS serial, no fixed firmware UUID, and
// a disk restored from the source's; the temporary snapshot and restore
// are gone.
func TestCloneFromVirtctlManifest(t *testing.T) {
	e := Start(t)
	startClones(e)
	e.Claim("root")
	dir := e.Dir("root")
	if err := os.WriteFile(filepath.Join(dir, "marker"), []byte("source"), 0o644); err != nil {
		t.Fatal(err)
	}
	vm := e.VM("golden", "root")
	vm.Labels = map[string]string{"app": "golden", "team.example.org/owner": "ops", "skip.example.org/x": "1"}
	vm.Annotations = map[string]string{"note": "kept"}
	vm.Spec.Template.ObjectMeta.Labels = map[string]string{"kubevirt.io/domain": "golden", "tmpl": "drop"}
	vm.Spec.Template.Spec.Domain.Devices.Interfaces = []kubevirtv1.Interface{
		{Name: "default", MacAddress: "02:aa:00:00:00:01"}, {Name: "second", MacAddress: "02:aa:00:00:00:02"}}
	vm.Spec.Template.Spec.Domain.Firmware = &kubevirtv1.Firmware{Serial: "old-serial", UUID: "5d307ca9-b3ef-428c-8861-06e72d69f223"}
	if _, err := e.Virt.VMs.Update(e.Ctx, vm); err != nil {
		t.Fatal(err)
	}

	bin, err := upstreamvirtctl.Binary(e.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(e.Ctx, bin, "create", "clone", "--name", "c1", "--source-name", "golden", "--target-name", "copy",
		"--label-filter", "*", "--label-filter", "!skip.example.org/*",
		"--new-mac-address", "default:02-bb-00-00-00-01", "--new-smbios-serial", "new-serial")
	cmd.Env = append(os.Environ(), "KUBECONFIG="+e.Kubecfg)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("virtctl create clone: %v\n%s", err, out)
	}
	manifest := filepath.Join(t.TempDir(), "clone.yaml")
	if err := os.WriteFile(manifest, out, 0o644); err != nil {
		t.Fatal(err)
	}
	e.Kubectl("apply", "-f", manifest)

	var vc *clonev1beta1.VirtualMachineClone
	testkit.Poll(t, 6*time.Minute, "clone succeeded", func() (bool, error) {
		var err error
		vc, err = e.Virt.VMClones.Get(e.Ctx, e.NS, "c1")
		return err == nil && (vc.Status.Phase == clonev1beta1.Succeeded || vc.Status.Phase == clonev1beta1.Failed), err
	})
	if vc.Status.Phase != clonev1beta1.Succeeded {
		t.Fatalf("clone %s: %+v", vc.Status.Phase, vc.Status.Conditions)
	}
	cp, err := e.Virt.VMs.Get(e.Ctx, e.NS, "copy")
	if err != nil {
		t.Fatal(err)
	}
	if cp.Labels["app"] != "golden" || cp.Labels["team.example.org/owner"] != "ops" || cp.Labels["skip.example.org/x"] != "" {
		t.Errorf("target labels %v: want all but skip.example.org/*", cp.Labels)
	}
	if cp.Annotations["note"] != "kept" {
		t.Errorf("target annotations %v: want note kept (no annotation filter)", cp.Annotations)
	}
	if l := cp.Spec.Template.ObjectMeta.Labels; l["kubevirt.io/domain"] != "golden" || l["tmpl"] != "drop" {
		t.Errorf("target template labels %v: want all (no template filter)", l)
	}
	ifaces := cp.Spec.Template.Spec.Domain.Devices.Interfaces
	if len(ifaces) != 2 || ifaces[0].MacAddress != "02-bb-00-00-00-01" || ifaces[1].MacAddress != "" {
		t.Errorf("target interfaces %+v: want the new MAC on default and none (a fresh one) on second", ifaces)
	}
	if fw := cp.Spec.Template.Spec.Domain.Firmware; fw == nil || fw.Serial != "new-serial" || fw.UUID != "" {
		t.Errorf("target firmware %+v: want serial new-serial and no uuid", fw)
	}
	claim := claimOf(cp, "disk")
	if claim == "" || claim == "root" {
		t.Fatalf("target disk claim %q: want a restored claim", claim)
	}
	if got, err := os.ReadFile(filepath.Join(e.Dir(claim), "marker")); err != nil || string(got) != "source" {
		t.Errorf("target disk marker %q (%v), want %q", got, err, "source")
	}
	testkit.Eventually(t, time.Minute, "temporary snapshot and restore gone", func() error {
		if _, err := e.Virt.VMSnapshots.Get(e.Ctx, e.NS, "tmp-snapshot-"+string(vc.UID)); !apierrors.IsNotFound(err) {
			return err
		}
		if _, err := e.Virt.VMRestores.Get(e.Ctx, e.NS, "tmp-restore-"+string(vc.UID)); !apierrors.IsNotFound(err) {
			return err
		}
		return nil
	})
	if out := e.Kubectl("get", "vmclone", "c1"); !strings.Contains(out, "SOURCEVIRTUALMACHINE") || !strings.Contains(out, "Succeeded") {
		t.Errorf("kubectl get vmclone:\n%s", out)
	}
	if _, err := e.Virt.VMs.Get(e.Ctx, e.NS, "golden"); err != nil {
		t.Errorf("source vm: %v", err)
	}

	// From a snapshot, with template filters, no target name: the
	// snapshot is kept, the target named in status.
	e.snapshot("golden-snap", "golden")
	e.waitSnapshot("golden-snap")
	group := "snapshot.kubevirt.io"
	fromSnap := &clonev1beta1.VirtualMachineClone{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "c2"},
		Spec: clonev1beta1.VirtualMachineCloneSpec{
			Source:   &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachineSnapshot", Name: "golden-snap"},
			Template: clonev1beta1.VirtualMachineCloneTemplateFilters{LabelFilters: []string{"kubevirt.io/*"}}}}
	if _, err := e.Virt.VMClones.Create(e.Ctx, fromSnap); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, 3*time.Minute, "clone from the snapshot succeeded", func() (bool, error) {
		var err error
		vc, err = e.Virt.VMClones.Get(e.Ctx, e.NS, "c2")
		return err == nil && (vc.Status.Phase == clonev1beta1.Succeeded || vc.Status.Phase == clonev1beta1.Failed), err
	})
	if vc.Status.Phase != clonev1beta1.Succeeded || vc.Status.TargetName == nil {
		t.Fatalf("clone from the snapshot %s: %+v", vc.Status.Phase, vc.Status)
	}
	second, err := e.Virt.VMs.Get(e.Ctx, e.NS, *vc.Status.TargetName)
	if err != nil {
		t.Fatal(err)
	}
	if l := second.Spec.Template.ObjectMeta.Labels; l["kubevirt.io/domain"] != "golden" || l["tmpl"] != "" {
		t.Errorf("second target's template labels %v: want only kubevirt.io/*", l)
	}
	if fw := second.Spec.Template.Spec.Domain.Firmware; fw == nil || fw.Serial == "" || fw.Serial == "old-serial" {
		t.Errorf("second target's firmware %+v: want a new serial", fw)
	}
	if _, err := e.Virt.VMSnapshots.Get(e.Ctx, e.NS, "golden-snap"); err != nil {
		t.Errorf("the source snapshot: %v (a clone keeps a snapshot it did not make)", err)
	}
}

// TestCloneToExistingVMFails: a clone never overwrites a VM it did not
// make.
func TestCloneToExistingVMFails(t *testing.T) {
	e := Start(t)
	startClones(e)
	e.Claim("a")
	e.Dir("a")
	e.VM("one", "a")
	e.VM("two", "a")
	vc := &clonev1beta1.VirtualMachineClone{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "clash"},
		Spec: clonev1beta1.VirtualMachineCloneSpec{Source: ref("VirtualMachine", "one"), Target: ref("VirtualMachine", "two")}}
	if _, err := e.Virt.VMClones.Create(e.Ctx, vc); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "clone failed", func() (bool, error) {
		got, err := e.Virt.VMClones.Get(e.Ctx, e.NS, "clash")
		return err == nil && got.Status.Phase == clonev1beta1.Failed, err
	})
}

func ref(kind, name string) *corev1.TypedLocalObjectReference {
	group := kubevirtv1.GroupVersion.Group
	return &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: kind, Name: name}
}
