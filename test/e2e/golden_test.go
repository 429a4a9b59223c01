package e2e

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestGoldenPathVM is the check from outside, on one VM written the
// way KubeVirt's documentation writes it: it boots from a disk imported
// over HTTP, on a bridge, with a MAC from the pool that the guest sees;
// it stops and starts with the same MAC and without a second import; once
// deleted it leaves nothing behind (VMI, domain, tap, DataVolume, claim,
// volume, state).
func TestGoldenPathVM(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	nad, br := n.bridgeNetwork("golden-net")
	poolDir := e.path("pools", poolName())
	volumesBefore := dirEntries(poolDir)

	vm := n.createVM(n.dataVolumeVM("golden", n.guestImageURL(), kubevirtv1.RunStrategyAlways,
		withBridge(nad), withUserData("#!/bin/sh\necho golden-$((6 * 7))\n")))
	poolMAC := vm.Spec.Template.Spec.Domain.Devices.Interfaces[0].MacAddress
	if poolMAC == "" {
		t.Errorf("the VM got no MAC at admission (clusterbrain/macpool)")
	}
	dv := n.waitImported("golden", "golden-root")
	if dv.Status.Progress != "100.0%" {
		t.Errorf("datavolume progress %q after Succeeded, want 100.0%%", dv.Status.Progress)
	}
	var uids []types.UID
	for i := 1; i <= 2; i++ {
		vmi := n.waitVMIOfVM("golden", 2*time.Minute, uids...)
		uids = append(uids, vmi.UID)
		s := n.serial("golden")
		mac := s.expect(`NODEVIRT-NIC eth0 (\S+)`, bootTimeout)[1]
		if poolMAC != "" && !strings.EqualFold(mac, poolMAC) {
			t.Errorf("boot %d: the guest's NIC has MAC %s, the pool gave %s", i, mac, poolMAC)
		}
		s.expect(`NODEVIRT-DISK vda \d+`, 10*time.Second)
		s.expect(`(?m)^golden-42\r?$`, 30*time.Second)
		s.expect(`NODEVIRT-GUEST-READY`, 30*time.Second)
		if taps := bridgePorts(br); len(taps) != 1 {
			t.Errorf("boot %d: bridge %s has ports %v, want the VM's one tap", i, br, taps)
		}
		if i == 1 {
			n.setRunStrategy("golden", kubevirtv1.RunStrategyHalted)
			n.waitGone("golden", 90*time.Second)
			n.setRunStrategy("golden", kubevirtv1.RunStrategyAlways)
		}
	}
	again, err := e.virt.DataVolumes.Get(context.Background(), n.name, "golden-root")
	if err != nil {
		t.Fatal(err)
	}
	if again.UID != dv.UID || again.Status.Phase != dv.Status.Phase {
		t.Errorf("the restart touched the DataVolume (uid %s→%s, phase %s→%s)", dv.UID, again.UID, dv.Status.Phase, again.Status.Phase)
	}
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(context.Background(), "golden-root", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv := pvc.Spec.VolumeName

	if err := e.virt.VMs.Delete(context.Background(), n.name, "golden", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n.waitGone("golden", 90*time.Second)
	n.eventually(90*time.Second, "nothing left of the deleted VM", func() (bool, string) {
		var left []string
		if _, err := n.getVM("golden"); !apierrors.IsNotFound(err) {
			left = append(left, fmt.Sprintf("vm (%v)", err))
		}
		if _, err := e.virt.DataVolumes.Get(context.Background(), n.name, "golden-root"); !apierrors.IsNotFound(err) {
			left = append(left, fmt.Sprintf("datavolume (%v)", err))
		}
		if _, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(context.Background(), "golden-root", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			left = append(left, fmt.Sprintf("pvc (%v)", err))
		}
		if _, err := e.kube.CoreV1().PersistentVolumes().Get(context.Background(), pv, metav1.GetOptions{}); pv != "" && !apierrors.IsNotFound(err) {
			left = append(left, fmt.Sprintf("pv %s (%v): nodeagent/provisioner did not delete it", pv, err))
		}
		if taps := bridgePorts(br); len(taps) > 0 {
			left = append(left, fmt.Sprintf("taps %v on bridge %s: nodeagent/handler did not detach them", taps, br))
		}
		if extra := newEntries(volumesBefore, dirEntries(poolDir)); len(extra) > 0 {
			left = append(left, fmt.Sprintf("volumes %v in pool %s: the CSI driver did not delete them", extra, poolDir))
		}
		for _, uid := range uids {
			if _, err := os.Stat(e.path("nodeagent", "vms", string(uid))); err == nil {
				left = append(left, "VM state directory "+e.path("nodeagent", "vms", string(uid)))
			}
		}
		return len(left) == 0, strings.Join(left, "; ")
	})
}

// bridgePorts lists the interfaces attached to a bridge.
func bridgePorts(br string) []string {
	return dirEntries("/sys/class/net/" + br + "/brif")
}

func dirEntries(dir string) []string {
	entries, _ := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func newEntries(before, after []string) []string {
	var out []string
	for _, a := range after {
		if !slices.Contains(before, a) {
			out = append(out, a)
		}
	}
	return out
}
