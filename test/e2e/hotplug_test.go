package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

// volumeStatus is the VMI's status entry of volume, nil when it has none.
func volumeStatus(vmi *kubevirtv1.VirtualMachineInstance, volume string) *kubevirtv1.VolumeStatus {
	if vmi == nil {
		return nil
	}
	for i := range vmi.Status.VolumeStatus {
		if vmi.Status.VolumeStatus[i].Name == volume {
			return &vmi.Status.VolumeStatus[i]
		}
	}
	return nil
}

// inTemplate reports whether the VM's template names volume.
func (n *testNS) inTemplate(vm, volume string) bool {
	n.t.Helper()
	got, err := n.getVM(vm)
	if err != nil {
		n.t.Fatal(err)
	}
	for _, v := range got.Spec.Template.Spec.Volumes {
		if v.Name == volume {
			return true
		}
	}
	return false
}

// TestUpstreamVirtctlHotplug plugs a blank DataVolume of the node-local
// hostpath-csi class (provisioned after the VM started) into a running VM
// with upstream virtctl: a dry run changes nothing; addvolume (ephemeral):
// the guest sees a new SCSI disk of the volume's size, the
// VMI reports it Ready and refuses a migration; removevolume takes it
// away again. With --persist the VM's template gets and loses it too.
func TestUpstreamVirtctlHotplug(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	u := n.upstreamVirtctl()
	const vm, dv = "hotplug", "hotplug-data"
	n.createVM(n.newVM(vm, kubevirtv1.RunStrategyAlways))
	vmi := n.waitVMIOfVM(vm, 2*time.Minute)
	n.waitBooted(vm)
	// Provisioned only now: the pool mounts the volume after QEMU started
	// in libvirt's mount namespace; the pool's shared mount carries it
	// there.
	if _, err := e.virt.DataVolumes.Create(context.Background(),
		immediateDV(n.name, dv, &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}})); err != nil {
		t.Fatal(err)
	}
	n.waitDataVolumeSucceeded(dv)

	u.run(time.Minute, "addvolume", vm, "--volume-name="+dv, "--dry-run")
	if got, err := n.getVMI(vm); err != nil || volumeStatus(got, dv) != nil || len(got.Spec.Volumes) != len(vmi.Spec.Volumes) {
		t.Fatalf("a dry run changed the VMI: %v", err)
	}

	c := n.console(vm)
	c.login()
	plugged := func(persist bool) {
		t.Helper()
		args := []string{"addvolume", vm, "--volume-name=" + dv}
		if persist {
			args = append(args, "--persist")
		}
		u.run(time.Minute, args...)
		got := n.waitVMI(vm, 3*time.Minute, dv+" Ready", func(v *kubevirtv1.VirtualMachineInstance) bool {
			st := volumeStatus(v, dv)
			return st != nil && st.Phase == kubevirtv1.VolumeReady
		})
		st := volumeStatus(got, dv)
		if st.HotplugVolume == nil || !strings.HasPrefix(st.Target, "sd") {
			t.Errorf("volumeStatus %+v", st)
		}
		if n.inTemplate(vm, dv) != persist {
			t.Errorf("VM template has %s: %v, want %v", dv, !persist, persist)
		}
		// A SCSI disk appears in the guest, which has none of its own
		// (its root disk is virtio).
		c.send("until ls /sys/block | grep -q ^sd; do sleep 1; done; echo PLUGGED-$((6*7))\r")
		c.expect(`PLUGGED-42`, time.Minute)
		n.waitVMI(vm, time.Minute, "LiveMigratable False", func(v *kubevirtv1.VirtualMachineInstance) bool {
			for _, cond := range v.Status.Conditions {
				if cond.Type == kubevirtv1.VirtualMachineInstanceIsMigratable {
					return cond.Status == corev1.ConditionFalse && cond.Reason == kubevirtv1.VirtualMachineInstanceReasonHotplugNotMigratable
				}
			}
			return false
		})
		if out := u.fail(time.Minute, "migrate", vm); !strings.Contains(out, kubevirtv1.VirtualMachineInstanceReasonHotplugNotMigratable) {
			t.Errorf("virtctl migrate with a hotplugged volume said %q", out)
		}
		args[0] = "removevolume"
		u.run(time.Minute, args...)
		n.waitVMI(vm, 2*time.Minute, dv+" unplugged", func(v *kubevirtv1.VirtualMachineInstance) bool {
			return v != nil && volumeStatus(v, dv) == nil
		})
		c.send("while ls /sys/block | grep -q ^sd; do sleep 1; done; echo UNPLUGGED-$((6*7))\r")
		c.expect(`UNPLUGGED-42`, time.Minute)
		if n.inTemplate(vm, dv) {
			t.Errorf("VM template keeps %s after removevolume", dv)
		}
	}
	plugged(false)
	plugged(true)
}
