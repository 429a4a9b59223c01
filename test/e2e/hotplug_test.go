package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/util/retry"
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

// editTemplate changes the VM's spec.template.spec with edit, as
// `kubectl edit vm` does (retried on a conflict).
func (n *testNS) editTemplate(vm string, edit func(*kubevirtv1.VirtualMachineInstanceSpec)) {
	n.t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		got, err := n.getVM(vm)
		if err != nil {
			return err
		}
		edit(&got.Spec.Template.Spec)
		_, err = n.e.virt.VMs.Update(context.Background(), got)
		return err
	})
	if err != nil {
		n.t.Fatalf("edit vm %s template: %v", vm, err)
	}
}

// restartRequired is the message of the VM's RestartRequired condition,
// "" when it has none.
func (n *testNS) restartRequired(vm string) string {
	n.t.Helper()
	got, err := n.getVM(vm)
	if err != nil {
		n.t.Fatal(err)
	}
	for _, c := range got.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineRestartRequired && c.Status == corev1.ConditionTrue {
			return c.Message
		}
	}
	return ""
}

// TestUpstreamVirtctlHotplug plugs a blank DataVolume of the node-local
// hostpath-csi class (provisioned after the VM started) into a running VM,
// with the lab's HyperConverged defaults (DeclarativeHotplugVolumes): a dry
// run changes nothing; an ephemeral addvolume into a VM's VMI is refused,
// as virt-api does with that gate; `virtctl addvolume --persist`, and then
// an edit of the VM's template, plug it: the guest sees a new SCSI disk,
// the VMI reports it Ready and refuses a migration; removevolume, and
// taking it out of the template, unplug it. A template change that cannot
// be applied live sets RestartRequired, which `virtctl restart` clears.
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

	u.run(time.Minute, "addvolume", vm, "--volume-name="+dv, "--persist", "--dry-run")
	if got, err := n.getVMI(vm); err != nil || volumeStatus(got, dv) != nil || len(got.Spec.Volumes) != len(vmi.Spec.Volumes) || n.inTemplate(vm, dv) {
		t.Fatalf("a dry run changed the VMI or the VM: %v", err)
	}
	if out := u.fail(time.Minute, "addvolume", vm, "--volume-name="+dv); !strings.Contains(out, "is owned by a VM") {
		t.Errorf("ephemeral addvolume into a VM's VMI said %q", out)
	}

	c := n.console(vm)
	c.login()
	plugged := func(how string, add, remove func()) {
		t.Helper()
		add()
		got := n.waitVMI(vm, 3*time.Minute, dv+" Ready ("+how+")", func(v *kubevirtv1.VirtualMachineInstance) bool {
			st := volumeStatus(v, dv)
			return st != nil && st.Phase == kubevirtv1.VolumeReady
		})
		st := volumeStatus(got, dv)
		if st.HotplugVolume == nil || !strings.HasPrefix(st.Target, "sd") {
			t.Errorf("%s: volumeStatus %+v", how, st)
		}
		if !n.inTemplate(vm, dv) {
			t.Errorf("%s: VM template lacks %s", how, dv)
		}
		if msg := n.restartRequired(vm); msg != "" {
			t.Errorf("%s: RestartRequired %q", how, msg)
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
		remove()
		n.waitVMI(vm, 2*time.Minute, dv+" unplugged ("+how+")", func(v *kubevirtv1.VirtualMachineInstance) bool {
			return v != nil && volumeStatus(v, dv) == nil
		})
		c.send("while ls /sys/block | grep -q ^sd; do sleep 1; done; echo UNPLUGGED-$((6*7))\r")
		c.expect(`UNPLUGGED-42`, time.Minute)
		if n.inTemplate(vm, dv) {
			t.Errorf("%s: VM template keeps %s after the removal", how, dv)
		}
	}
	plugged("virtctl --persist", func() { u.run(time.Minute, "addvolume", vm, "--volume-name="+dv, "--persist") },
		func() { u.run(time.Minute, "removevolume", vm, "--volume-name="+dv, "--persist") })
	plugged("template edit", func() {
		n.editTemplate(vm, func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Devices.Disks = append(s.Domain.Devices.Disks, kubevirtv1.Disk{Name: dv,
				DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}})
			s.Volumes = append(s.Volumes, kubevirtv1.Volume{Name: dv,
				VolumeSource: kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: dv, Hotpluggable: true}}})
		})
	}, func() {
		n.editTemplate(vm, func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Devices.Disks = slices.DeleteFunc(s.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool { return d.Name == dv })
			s.Volumes = slices.DeleteFunc(s.Volumes, func(v kubevirtv1.Volume) bool { return v.Name == dv })
		})
	})

	// Not live-updatable: RestartRequired until the VM restarts.
	n.editTemplate(vm, func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		grace := int64(7)
		s.TerminationGracePeriodSeconds = &grace
	})
	n.eventually(time.Minute, "vm RestartRequired", func() (bool, string) {
		msg := n.restartRequired(vm)
		return msg == "a non-live-updatable field was changed in the template spec", fmt.Sprintf("RestartRequired %q", msg)
	})
	before, err := n.getVMI(vm)
	if err != nil {
		t.Fatal(err)
	}
	u.run(time.Minute, "restart", vm)
	n.waitVMIOfVM(vm, 3*time.Minute, before.UID)
	n.eventually(time.Minute, "RestartRequired cleared by the restart", func() (bool, string) {
		msg := n.restartRequired(vm)
		return msg == "", fmt.Sprintf("RestartRequired %q", msg)
	})
}
