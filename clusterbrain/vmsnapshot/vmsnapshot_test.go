package vmsnapshot

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

func (e *Env) snapshot(name, vm string) {
	e.T.Helper()
	group := kubevirtv1.GroupVersion.Group
	s := &snapv1beta1.VirtualMachineSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: name},
		Spec: snapv1beta1.VirtualMachineSnapshotSpec{Source: corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachine", Name: vm}}}
	if _, err := e.Virt.VMSnapshots.Create(e.Ctx, s); err != nil {
		e.T.Fatal(err)
	}
}

func (e *Env) waitSnapshot(name string) *snapv1beta1.VirtualMachineSnapshot {
	e.T.Helper()
	var s *snapv1beta1.VirtualMachineSnapshot
	testkit.Poll(e.T, 2*time.Minute, "vmsnapshot "+name+" succeeded", func() (bool, error) {
		var err error
		s, err = e.Virt.VMSnapshots.Get(e.Ctx, e.NS, name)
		return err == nil && s.Status != nil && s.Status.Phase == snapv1beta1.Succeeded, err
	})
	return s
}

func (e *Env) restore(name, snapshot, target string, policy *snapv1beta1.TargetReadinessPolicy) {
	e.T.Helper()
	group := kubevirtv1.GroupVersion.Group
	r := &snapv1beta1.VirtualMachineRestore{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: name},
		Spec: snapv1beta1.VirtualMachineRestoreSpec{VirtualMachineSnapshotName: snapshot, TargetReadinessPolicy: policy,
			Target: corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachine", Name: target}}}
	if _, err := e.Virt.VMRestores.Create(e.Ctx, r); err != nil {
		e.T.Fatal(err)
	}
}

func (e *Env) waitRestore(name string) *snapv1beta1.VirtualMachineRestore {
	e.T.Helper()
	var r *snapv1beta1.VirtualMachineRestore
	testkit.Poll(e.T, 2*time.Minute, "vmrestore "+name+" complete", func() (bool, error) {
		var err error
		r, err = e.Virt.VMRestores.Get(e.Ctx, e.NS, name)
		return err == nil && restoreComplete(r), err
	})
	return r
}

func condition(conds []snapv1beta1.Condition, t snapv1beta1.ConditionType) (corev1.ConditionStatus, string) {
	for _, c := range conds {
		if c.Type == t {
			return c.Status, c.Reason
		}
	}
	return "", ""
}

func claimOf(vm *kubevirtv1.VirtualMachine, volume string) string {
	for _, v := range vm.Spec.Template.Spec.Volumes {
		if v.Name == volume && v.PersistentVolumeClaim != nil {
			return v.PersistentVolumeClaim.ClaimName
		}
	}
	return ""
}

// TestOfflineSnapshotRestoresToANewVM: a stopped VM's claim is
// snapshotted through a real CSI VolumeSnapshot; the content keeps the VM
// and the claim; a restore to another name creates a stopped VM on a
// claim restored from the snapshot, holding what the disk held when it
// was snapshotted (not what was written after).
func TestOfflineSnapshotRestoresToANewVM(t *testing.T) {
	e := Start(t)
	e.Claim("data")
	dir := e.Dir("data")
	if err := os.WriteFile(filepath.Join(dir, "marker"), []byte("before"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.VM("src", "data")
	e.snapshot("snap", "src")
	s := e.waitSnapshot("snap")
	if s.Status.ReadyToUse == nil || !*s.Status.ReadyToUse || s.Status.CreationTime == nil {
		t.Errorf("snapshot status %+v: want readyToUse and a creation time", s.Status)
	}
	if st, reason := condition(s.Status.Conditions, snapv1beta1.ConditionReady); st != corev1.ConditionTrue {
		t.Errorf("Ready %s %q, want True", st, reason)
	}
	if st, _ := condition(s.Status.Conditions, snapv1beta1.ConditionProgressing); st != corev1.ConditionFalse {
		t.Errorf("Progressing %s, want False once done", st)
	}
	if len(s.Status.Indications) != 0 {
		t.Errorf("offline snapshot indications %v, want none", s.Status.Indications)
	}
	if v := s.Status.SnapshotVolumes; v == nil || !slices.Equal(v.IncludedVolumes, []string{"disk"}) {
		t.Errorf("snapshot volumes %+v, want disk included", v)
	}
	content, err := e.Virt.VMSnapshotContents.Get(e.Ctx, e.NS, ContentName(s))
	if err != nil {
		t.Fatal(err)
	}
	if vm := content.Spec.Source.VirtualMachine; vm == nil || vm.Name != "src" || len(content.Spec.VolumeBackups) != 1 ||
		content.Spec.VolumeBackups[0].PersistentVolumeClaim.Name != "data" {
		t.Fatalf("content spec %+v: want vm src and one backup of claim data", content.Spec)
	}
	vm, err := e.Virt.VMs.Get(e.Ctx, e.NS, "src")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Status.SnapshotInProgress != nil {
		t.Errorf("vm still locked by %s", *vm.Status.SnapshotInProgress)
	}
	if out := e.Kubectl("get", "vmsnapshot", "snap"); !strings.Contains(out, "SOURCEKIND") || !strings.Contains(out, "Succeeded") ||
		!strings.Contains(out, "true") {
		t.Errorf("kubectl get vmsnapshot:\n%s", out)
	}

	// Written after the snapshot: the restore must not have it.
	if err := os.WriteFile(filepath.Join(dir, "marker"), []byte("after"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.restore("to-new", "snap", "copy", nil)
	r := e.waitRestore("to-new")
	if st, _ := condition(r.Status.Conditions, snapv1beta1.ConditionReady); st != corev1.ConditionTrue || r.Status.RestoreTime == nil {
		t.Errorf("restore status %+v", r.Status)
	}
	cp, err := e.Virt.VMs.Get(e.Ctx, e.NS, "copy")
	if err != nil {
		t.Fatal(err)
	}
	claim := claimOf(cp, "disk")
	if want := "restore-" + string(r.UID) + "-disk"; claim != want {
		t.Fatalf("restored vm's disk claim %q, want %q", claim, want)
	}
	if rs := cp.Spec.RunStrategy; rs == nil || *rs != kubevirtv1.RunStrategyHalted {
		t.Errorf("restored vm run strategy %v, want Halted", rs)
	}
	if cp.Labels["app"] != "src" {
		t.Errorf("restored vm labels %v, want the source's", cp.Labels)
	}
	got, err := os.ReadFile(filepath.Join(e.Dir(claim), "marker"))
	if err != nil || string(got) != "before" {
		t.Errorf("restored disk's marker %q (%v), want %q", got, err, "before")
	}
	pvc, err := e.Kube.CoreV1().PersistentVolumeClaims(e.NS).Get(e.Ctx, claim, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ref := metav1.GetControllerOf(pvc); ref == nil || ref.Kind != "VirtualMachine" || ref.UID != cp.UID {
		t.Errorf("restored claim's controller %+v, want vm copy", ref)
	}
	if out := e.Kubectl("get", "vmrestore", "to-new"); !strings.Contains(out, "TARGETNAME") || !strings.Contains(out, "copy") {
		t.Errorf("kubectl get vmrestore:\n%s", out)
	}

	// Deleting the snapshot (deletionPolicy Delete by default) deletes
	// its content and VolumeSnapshots.
	if err := e.Virt.VMSnapshots.Delete(e.Ctx, e.NS, "snap", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	vsName := *content.Spec.VolumeBackups[0].VolumeSnapshotName
	testkit.Eventually(t, time.Minute, "snapshot, content and volume snapshot gone", func() error {
		for _, err := range []error{
			func() error { _, err := e.Virt.VMSnapshots.Get(e.Ctx, e.NS, "snap"); return err }(),
			func() error { _, err := e.Virt.VMSnapshotContents.Get(e.Ctx, e.NS, content.Name); return err }(),
			func() error { _, err := e.Snaps.Snapshots.Get(e.Ctx, e.NS, vsName); return err }(),
		} {
			if !apierrors.IsNotFound(err) {
				return err
			}
		}
		return nil
	})
}

// TestOnlineSnapshotFreezesAndRestoreStopsTarget: a snapshot of a running
// VM with a connected agent is Online with GuestAgent, the guest frozen
// before the VolumeSnapshot is taken and thawed after; a restore onto the
// running VM waits, and with StopTarget stops it, then puts it on the
// restored claim.
func TestOnlineSnapshotFreezesAndRestoreStopsTarget(t *testing.T) {
	e := Start(t)
	e.Claim("root")
	e.Dir("root")
	vm := e.VM("web", "root")
	e.RunningVMI("web", true)
	var atFreeze atomic.Int32 // VolumeSnapshots in the namespace when the guest was frozen
	atFreeze.Store(-1)
	e.Freezer.OnFreeze = func() {
		if l, err := e.Snaps.Snapshots.List(e.Ctx, e.NS, metav1.ListOptions{}); err == nil {
			atFreeze.Store(int32(len(l)))
		}
	}
	e.snapshot("live", "web")
	s := e.waitSnapshot("live")
	for _, want := range []snapv1beta1.Indication{snapv1beta1.VMSnapshotOnlineSnapshotIndication, snapv1beta1.VMSnapshotGuestAgentIndication} {
		if !slices.Contains(s.Status.Indications, want) {
			t.Errorf("indications %v, want %s", s.Status.Indications, want)
		}
	}
	if calls := e.Freezer.Calls(); len(calls) < 2 || calls[0] != "freeze web" || calls[len(calls)-1] != "thaw web" {
		t.Errorf("freezer calls %v, want a freeze then a thaw", calls)
	}
	if n := atFreeze.Load(); n != 0 {
		t.Errorf("%d volume snapshots existed when the guest was frozen, want 0", n)
	}

	stop := snapv1beta1.VirtualMachineRestoreStopTarget
	e.restore("back", "live", "web", &stop)
	testkit.Poll(t, time.Minute, "target stopped for the restore", func() (bool, error) {
		got, err := e.Virt.VMs.Get(e.Ctx, e.NS, "web")
		return err == nil && got.Spec.RunStrategy != nil && *got.Spec.RunStrategy == kubevirtv1.RunStrategyHalted, err
	})
	r, err := e.Virt.VMRestores.Get(e.Ctx, e.NS, "back")
	if err != nil {
		t.Fatal(err)
	}
	if restoreComplete(r) {
		t.Fatal("restore completed while the target's VMI runs")
	}
	// The VM controller's part: the stopped VM's VMI goes.
	if err := e.Virt.VMIs.Delete(e.Ctx, e.NS, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r = e.waitRestore("back")
	got, err := e.Virt.VMs.Get(e.Ctx, e.NS, "web")
	if err != nil {
		t.Fatal(err)
	}
	if claim := claimOf(got, "disk"); claim != "restore-"+string(r.UID)+"-disk" {
		t.Errorf("vm disk claim %q after the restore", claim)
	}
	if got.UID != vm.UID || got.Annotations[AnnLastRestore] != "back-"+string(r.UID) {
		t.Errorf("restore replaced the vm or did not stamp it: %v", got.Annotations)
	}
	if got.Status.RestoreInProgress != nil {
		t.Errorf("vm still locked by restore %s", *got.Status.RestoreInProgress)
	}
}

// TestSnapshotOfRunningVMWithoutAgent: Online and NoGuestAgent, no freeze.
func TestSnapshotOfRunningVMWithoutAgent(t *testing.T) {
	e := Start(t)
	e.Claim("root")
	e.Dir("root")
	e.VM("plain", "root")
	e.RunningVMI("plain", false)
	e.snapshot("s", "plain")
	s := e.waitSnapshot("s")
	if !slices.Equal(s.Status.Indications, []snapv1beta1.Indication{snapv1beta1.VMSnapshotOnlineSnapshotIndication, snapv1beta1.VMSnapshotNoGuestAgentIndication}) {
		t.Errorf("indications %v, want Online NoGuestAgent", s.Status.Indications)
	}
	if calls := e.Freezer.Calls(); len(calls) != 0 {
		t.Errorf("freezer called without an agent: %v", calls)
	}
}

// TestSnapshotOfMissingVMFailsAtDeadline: the snapshot waits for its
// source and fails once its failureDeadline passes.
func TestSnapshotOfMissingVMFailsAtDeadline(t *testing.T) {
	e := Start(t)
	group := kubevirtv1.GroupVersion.Group
	s := &snapv1beta1.VirtualMachineSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: e.NS, Name: "orphan"},
		Spec: snapv1beta1.VirtualMachineSnapshotSpec{FailureDeadline: &metav1.Duration{Duration: 3 * time.Second},
			Source: corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachine", Name: "nowhere"}}}
	if _, err := e.Virt.VMSnapshots.Create(e.Ctx, s); err != nil {
		t.Fatal(err)
	}
	testkit.Poll(t, time.Minute, "snapshot failed", func() (bool, error) {
		got, err := e.Virt.VMSnapshots.Get(e.Ctx, e.NS, "orphan")
		return err == nil && got.Status != nil && got.Status.Phase == snapv1beta1.Failed && got.Status.Error != nil, err
	})
}

// TestV1alpha1IsServed: a v1alpha1 snapshot manifest applies and reads
// back as v1beta1.
func TestV1alpha1IsServed(t *testing.T) {
	e := Start(t)
	manifest := filepath.Join(t.TempDir(), "snap.yaml")
	if err := os.WriteFile(manifest, []byte(`apiVersion: snapshot.kubevirt.io/v1alpha1
kind: VirtualMachineSnapshot
metadata:
  name: old-api
spec:
  source:
    apiGroup: kubevirt.io
    kind: VirtualMachine
    name: none
`), 0o644); err != nil {
		t.Fatal(err)
	}
	e.Kubectl("apply", "-f", manifest)
	if _, err := e.Virt.VMSnapshots.Get(e.Ctx, e.NS, "old-api"); err != nil {
		t.Fatal(err)
	}
}
