package handler

import (
	"context"
	"strconv"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/guest"
)

// hotplugStatus is the volumeStatus entry of name, nil when there is none.
func hotplugStatus(vmi *v1.VirtualMachineInstance, name string) *v1.VolumeStatus {
	if vmi == nil {
		return nil
	}
	return volumeStatusOf(vmi, name)
}

// TestHotplugVolume plugs a filesystem volume of the hostpath CSI driver,
// created and mounted after the guest started, into the running guest the way the addvolume subresource asks for it (a
// hotpluggable claim volume and a SCSI disk added to the VMI's spec): the
// guest sees sda appear with the volume's size, volumeStatus says Ready
// with its target, and LiveMigratable turns False. A volume whose claim
// does not exist stays Pending. Removing the volume from the spec
// unplugs it: sda disappears in the guest and LiveMigratable is True again.
func TestHotplugVolume(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	n := newNode(t)
	n.bootVolume(ctx, "boot")
	h, _ := n.handler(true)

	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "hot"},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("128Mi")}},
				Devices: v1.Devices{AutoattachGraphicsDevice: new(bool),
					Disks: []v1.Disk{{Name: "boot", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}}},
			},
			Volumes: []v1.Volume{{Name: "boot", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "boot"}}}}},
		},
	}
	paused := v1.StartStrategyPaused
	vmi.Spec.StartStrategy = &paused
	n.schedule(ctx, vmi)
	n.waitVMI(ctx, "hot", startTimeout, "Running and paused", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Running && isTrue(v, v1.VirtualMachineInstancePaused)
	})
	cc := n.consoleClient(h)
	conn, err := cc.Console(ctx, n.ns, "hot")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	log := guest.ReadConsole(conn)
	if err := cc.Do(ctx, n.ns, "hot", "unpause"); err != nil {
		t.Fatal(err)
	}
	log.ExpectExact(t, "NODEVIRT-GUEST-READY", bootTimeout)
	log.Login(t, conn, 30*time.Second)
	// The data volume is made and mounted by the pool only now, after
	// QEMU started in its own mount namespace: the pool's shared volumes
	// directory carries the mount there.
	dataSize := n.bootVolume(ctx, "data")
	say := func(cmd string) {
		t.Helper()
		if _, err := conn.Write([]byte(cmd + "\n")); err != nil {
			t.Fatal(err)
		}
	}

	// What the subresource writes: a hotpluggable volume and its disk.
	update := func(change func(*v1.VirtualMachineInstance)) {
		t.Helper()
		cur, err := n.virt.VMIs.Get(ctx, n.ns, "hot")
		if err != nil {
			t.Fatal(err)
		}
		change(cur)
		if _, err := n.virt.VMIs.Update(ctx, cur); err != nil {
			t.Fatal(err)
		}
	}
	plug := func(v *v1.VirtualMachineInstance, name, claim string) {
		v.Spec.Volumes = append(v.Spec.Volumes, v1.Volume{Name: name, VolumeSource: v1.VolumeSource{
			PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{Hotpluggable: true,
				PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}})
		v.Spec.Domain.Devices.Disks = append(v.Spec.Domain.Devices.Disks, v1.Disk{Name: name,
			DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusSCSI}}})
	}
	unplug := func(v *v1.VirtualMachineInstance, name string) {
		for i := range v.Spec.Volumes {
			if v.Spec.Volumes[i].Name == name {
				v.Spec.Volumes = append(v.Spec.Volumes[:i], v.Spec.Volumes[i+1:]...)
				break
			}
		}
		for i := range v.Spec.Domain.Devices.Disks {
			if v.Spec.Domain.Devices.Disks[i].Name == name {
				v.Spec.Domain.Devices.Disks = append(v.Spec.Domain.Devices.Disks[:i], v.Spec.Domain.Devices.Disks[i+1:]...)
				break
			}
		}
	}

	update(func(v *v1.VirtualMachineInstance) { plug(v, "data", "data"); plug(v, "nothere", "no-such-claim") })
	got := n.waitVMI(ctx, "hot", 60*time.Second, "data Ready", func(v *v1.VirtualMachineInstance) bool {
		st := hotplugStatus(v, "data")
		return st != nil && st.Phase == v1.VolumeReady
	})
	if st := hotplugStatus(got, "data"); st.Target != "sda" || st.HotplugVolume == nil || st.PersistentVolumeClaimInfo == nil ||
		st.PersistentVolumeClaimInfo.ClaimName != "data" {
		t.Errorf("volumeStatus of data: %+v", st)
	}
	if st := hotplugStatus(got, "nothere"); st == nil || st.Phase != v1.VolumePending || st.Reason != reasonVolumePending {
		t.Errorf("volumeStatus of a volume without a claim: %+v", st)
	}
	if st := hotplugStatus(got, "boot"); st == nil || st.HotplugVolume != nil || st.Target != "vda" {
		t.Errorf("volumeStatus of the boot volume: %+v", st)
	}
	if c := condition(got, v1.VirtualMachineInstanceIsMigratable); c == nil || c.Status != k8sv1.ConditionFalse ||
		c.Reason != v1.VirtualMachineInstanceReasonHotplugNotMigratable {
		t.Errorf("LiveMigratable with a hotplugged volume: %+v", c)
	}
	say("until [ -e /sys/block/sda ]; do sleep 1; done; echo SDA-SECTORS-$(cat /sys/block/sda/size)")
	log.ExpectExact(t, "SDA-SECTORS-"+strconv.FormatInt(dataSize/512, 10), 60*time.Second)

	update(func(v *v1.VirtualMachineInstance) { unplug(v, "data"); unplug(v, "nothere") })
	got = n.waitVMI(ctx, "hot", 60*time.Second, "unplugged and migratable", func(v *v1.VirtualMachineInstance) bool {
		return hotplugStatus(v, "data") == nil && hotplugStatus(v, "nothere") == nil && isTrue(v, v1.VirtualMachineInstanceIsMigratable)
	})
	say("while [ -e /sys/block/sda ]; do sleep 1; done; echo SDA-GONE-$((6*7))")
	log.ExpectExact(t, "SDA-GONE-42", 60*time.Second)
	dom, err := n.lv.DomainXML(ctx, n.ns+"_hot")
	if err != nil {
		t.Fatal(err)
	}
	if len(dom.Devices.Disks) != 1 {
		t.Errorf("domain keeps %d disks after the unplug", len(dom.Devices.Disks))
	}
}
