package e2e

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	"github.com/nodevirt/nodevirt/test/guest"
)

// agentImageURL serves a qcow2 boot disk of the guest with the QEMU guest
// agent.
func (n *testNS) agentImageURL() string {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	raw, err := guest.BootDisk(ctx, guest.DiskSpec{Initramfs: guest.Spec{GuestAgent: true}})
	if err != nil {
		n.t.Fatalf("guest image with agent: %v", err)
	}
	image, err := guest.QCOW2(ctx, raw)
	if err != nil {
		n.t.Fatalf("guest qcow2 image: %v", err)
	}
	return serveFile(n.t, image)
}

// TestVMSnapshotOfRunningVMRestores: a running VM with a guest agent writes
// a mark on its data disk; a VirtualMachineSnapshot taken while it runs is
// Online with GuestAgent (the guest frozen through its node); the guest
// then overwrites the mark; the VM is stopped and restored from the
// snapshot; started again, it reads the mark it had when snapshotted.
func TestVMSnapshotOfRunningVMRestores(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()

	vm := withLocalDataDisk(n.dataVolumeVM("snapvm", n.agentImageURL(), kubevirtv1.RunStrategyAlways))
	n.createVM(vm)
	n.waitImported("snapvm", "snapvm-root")
	first := n.waitVMIOfVM("snapvm", 2*time.Minute)
	n.waitBooted("snapvm")
	n.waitVMI("snapvm", 2*time.Minute, "guest agent connected", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		for _, c := range vmi.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineInstanceAgentConnected && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	n.writeMarks("snapvm", "SNAPSHOT-STATE")

	group := kubevirtv1.GroupVersion.Group
	snap := &snapv1beta1.VirtualMachineSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: n.name, Name: "snap"},
		Spec: snapv1beta1.VirtualMachineSnapshotSpec{Source: corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachine", Name: "snapvm"}}}
	if _, err := e.virt.VMSnapshots.Create(ctx, snap); err != nil {
		t.Fatal(err)
	}
	var got *snapv1beta1.VirtualMachineSnapshot
	n.eventually(3*time.Minute, "vmsnapshot snap succeeded", func() (bool, string) {
		s, err := e.virt.VMSnapshots.Get(ctx, n.name, "snap")
		if err != nil {
			return false, err.Error()
		}
		got = s
		if s.Status == nil {
			return false, "no status"
		}
		return s.Status.Phase == snapv1beta1.Succeeded, fmt.Sprintf("status %+v", *s.Status)
	})
	for _, want := range []snapv1beta1.Indication{snapv1beta1.VMSnapshotOnlineSnapshotIndication, snapv1beta1.VMSnapshotGuestAgentIndication} {
		if !slices.Contains(got.Status.Indications, want) {
			t.Errorf("snapshot indications %v, want %s", got.Status.Indications, want)
		}
	}
	if v := got.Status.SnapshotVolumes; v == nil || !slices.Contains(v.IncludedVolumes, "data") || !slices.Contains(v.IncludedVolumes, "rootdisk") {
		t.Errorf("snapshot volumes %+v, want rootdisk and data", v)
	}

	// The guest was thawed: it writes again.
	n.writeMarks("snapvm", "AFTER-SNAPSHOT")
	n.setRunStrategy("snapvm", kubevirtv1.RunStrategyHalted)
	n.waitGone("snapvm", 2*time.Minute)

	restore := &snapv1beta1.VirtualMachineRestore{ObjectMeta: metav1.ObjectMeta{Namespace: n.name, Name: "back"},
		Spec: snapv1beta1.VirtualMachineRestoreSpec{VirtualMachineSnapshotName: "snap",
			Target: corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VirtualMachine", Name: "snapvm"}}}
	if _, err := e.virt.VMRestores.Create(ctx, restore); err != nil {
		t.Fatal(err)
	}
	n.eventually(3*time.Minute, "vmrestore back complete", func() (bool, string) {
		r, err := e.virt.VMRestores.Get(ctx, n.name, "back")
		if err != nil {
			return false, err.Error()
		}
		if r.Status == nil {
			return false, "no status"
		}
		return r.Status.Complete != nil && *r.Status.Complete, fmt.Sprintf("status %+v", *r.Status)
	})
	n.setRunStrategy("snapvm", kubevirtv1.RunStrategyAlways)
	n.waitVMIOfVM("snapvm", 2*time.Minute, first.UID)
	n.waitBooted("snapvm")
	if facts := n.readFacts("snapvm"); facts.disk != "SNAPSHOT-STATE" {
		t.Errorf("restored data disk holds %q, want the snapshot's %q", facts.disk, "SNAPSHOT-STATE")
	}
}
