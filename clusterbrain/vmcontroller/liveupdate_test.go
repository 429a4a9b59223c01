package vmcontroller

import (
	"context"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
)

// boundClaim makes a claim bound to a volume that is on no particular
// node, so it can be hotplugged wherever the VMI runs.
func (e env) boundClaim(name string) {
	e.t.Helper()
	ctx := context.Background()
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: e.ns + "-" + name},
		Spec: corev1.PersistentVolumeSpec{Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/nonexistent"}}}}
	if _, err := e.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		_ = e.kube.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
	})
	empty := ""
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &empty, VolumeName: pv.Name,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

// runningVM starts a VM and reports its VMI Running on node-1.
func (e env) runningVM(name string) *kubevirtv1.VirtualMachineInstance {
	e.t.Helper()
	e.newVM(name, nil)
	_, vmi := e.waitVM(name, "vmi created", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi != nil })
	e.setVMIPhase(vmi, kubevirtv1.Running, true)
	e.waitVM(name, "running", status(kubevirtv1.VirtualMachineStatusRunning))
	return vmi
}

func restartRequired(vm *kubevirtv1.VirtualMachine) (string, bool) {
	for _, c := range vm.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineRestartRequired && c.Status == corev1.ConditionTrue {
			return c.Message, true
		}
	}
	return "", false
}

func hasVolume(vmi *kubevirtv1.VirtualMachineInstance, name string) bool {
	if vmi == nil {
		return false
	}
	vol, disk := false, false
	for _, v := range vmi.Spec.Volumes {
		vol = vol || v.Name == name
	}
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		disk = disk || d.Name == name
	}
	return vol && disk
}

// templateVolumes is a merge patch setting the template's disks and
// volumes: the root container disk plus extra.
func templateVolumes(extra ...string) string {
	disks := []string{`{"name":"root"}`}
	vols := []string{`{"name":"root","containerDisk":{"image":"example/disk"}}`}
	for _, x := range extra {
		d, v, _ := strings.Cut(x, "|")
		disks, vols = append(disks, d), append(vols, v)
	}
	return fmt.Sprintf(`{"spec":{"template":{"spec":{"domain":{"devices":{"disks":[%s]}},"volumes":[%s]}}}}`,
		strings.Join(disks, ","), strings.Join(vols, ","))
}

const (
	hotData  = `{"name":"data","disk":{"bus":"scsi"}}|{"name":"data","persistentVolumeClaim":{"claimName":"data","hotpluggable":true}}`
	coldData = `{"name":"cold","disk":{"bus":"virtio"}}|{"name":"cold","persistentVolumeClaim":{"claimName":"cold"}}`
	hotVirt  = `{"name":"virt","disk":{"bus":"virtio"}}|{"name":"virt","persistentVolumeClaim":{"claimName":"data","hotpluggable":true}}`
)

// With declarative hotplug, a hotpluggable claim added to a running VM's
// template is plugged into its VMI and unplugged when removed, with no
// RestartRequired; a non-hotpluggable volume, or one on a bus the node
// cannot hotplug, sets RestartRequired, which a restart clears.
func TestDeclarativeHotplugAndRestartRequired(t *testing.T) {
	gates := &live.Value[rollout.Cluster]{}
	gates.Set(rollout.Cluster{DeclarativeHotplug: true})
	e := setup(t, func(c *Config) { c.Rollout = gates })
	e.boundClaim("data")
	first := e.runningVM("decl")
	if first.Annotations[AnnStartSpec] == "" {
		t.Fatalf("vmi has no %s annotation: %v", AnnStartSpec, first.Annotations)
	}

	e.patchVM("decl", templateVolumes(hotData))
	vm, vmi := e.waitVM("decl", "data plugged", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return hasVolume(vmi, "data")
	})
	if msg, ok := restartRequired(vm); ok {
		t.Errorf("RestartRequired after a hotpluggable volume was added: %s", msg)
	}
	for _, d := range vmi.Spec.Domain.Devices.Disks {
		if d.Name == "data" && (d.Disk == nil || d.Disk.Bus != kubevirtv1.DiskBusSCSI) {
			t.Errorf("plugged disk %+v", d)
		}
	}

	e.patchVM("decl", templateVolumes())
	e.waitVM("decl", "data unplugged", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		_, restart := restartRequired(vm)
		return vmi != nil && !hasVolume(vmi, "data") && len(vmi.Spec.Volumes) == 1 && !restart
	})

	// Not hotpluggable: staged for the restart, with upstream's message.
	e.patchVM("decl", templateVolumes(coldData))
	vm, vmi = e.waitVM("decl", "restart required", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		_, ok := restartRequired(vm)
		return ok
	})
	if msg, _ := restartRequired(vm); msg != msgRestartRequired {
		t.Errorf("RestartRequired message %q", msg)
	}
	if hasVolume(vmi, "cold") {
		t.Error("a volume that is not hotpluggable reached the running VMI")
	}

	// Back to the start: nothing is left to restart for.
	e.patchVM("decl", templateVolumes())
	e.waitVM("decl", "restart no longer required", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		_, ok := restartRequired(vm)
		return !ok
	})

	// Hotpluggable but on virtio: the node cannot plug it live.
	e.patchVM("decl", templateVolumes(hotVirt))
	vm, vmi = e.waitVM("decl", "restart required for virtio", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		_, ok := restartRequired(vm)
		return ok
	})
	if msg, _ := restartRequired(vm); !strings.Contains(msg, "volume virt") || !strings.Contains(msg, "scsi") {
		t.Errorf("RestartRequired message %q", msg)
	}
	if hasVolume(vmi, "virt") {
		t.Error("a virtio disk was hotplugged")
	}

	// A restart applies it and clears the condition.
	if err := e.virt.VMIs.Delete(context.Background(), e.ns, "decl", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	_, second := e.waitVM("decl", "restarted", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil && vmi.UID != first.UID
	})
	if !hasVolume(second, "virt") {
		t.Errorf("restarted vmi lacks the virtio volume: %+v", second.Spec.Volumes)
	}
	e.setVMIPhase(second, kubevirtv1.Running, true)
	e.waitVM("decl", "restart requirement cleared", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		_, ok := restartRequired(vm)
		return !ok && vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusRunning
	})
}

// Without declarative hotplug (the HotplugVolumes gate), a hotpluggable
// volume added to the template waits for the restart, as upstream: not
// plugged, and no RestartRequired.
func TestTemplateHotplugStagedWithoutDeclarativeGate(t *testing.T) {
	gates := &live.Value[rollout.Cluster]{}
	gates.Set(rollout.Cluster{})
	e := setup(t, func(c *Config) { c.Rollout = gates })
	e.boundClaim("data")
	e.runningVM("staged")
	e.patchVM("staged", templateVolumes(hotData))
	// The controller has seen the edit once the VM's observedGeneration
	// follows it.
	vm, vmi := e.waitVM("staged", "edit observed", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm.Status.ObservedGeneration == vm.Generation && vm.Generation > 1
	})
	if hasVolume(vmi, "data") {
		t.Error("volume plugged without the declarative gate")
	}
	if msg, ok := restartRequired(vm); ok {
		t.Errorf("RestartRequired for a hotpluggable volume: %s", msg)
	}
}
