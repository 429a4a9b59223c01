package subresources

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// claimOn makes the claim name, bound to a PV on node ("" for none), or
// unbound in class when node is "-".
func claimOn(t *testing.T, ns, name, node, class string) {
	t.Helper()
	ctx := context.Background()
	kube := controlplane.Shared(t).Clientset(t)
	size := resource.MustParse("64Mi")
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}}}}
	if node == "-" {
		pvc.Spec.StorageClassName = &class
	} else {
		pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-" + ns + "-" + name},
			Spec: corev1.PersistentVolumeSpec{Capacity: corev1.ResourceList{corev1.ResourceStorage: size},
				AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeSource: corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/nonexistent"}},
				ClaimRef:               &corev1.ObjectReference{Namespace: ns, Name: name},
				NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
					MatchExpressions: []corev1.NodeSelectorRequirement{{Key: importstate.HostpathTopologyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{node}}}}}}}}}
		if _, err := kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			kube.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
		})
		empty := ""
		pvc.Spec.StorageClassName, pvc.Spec.VolumeName = &empty, pv.Name
	}
	if _, err := kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func addOpts(name string, bus kubevirtv1.DiskBus, dryRun bool) *kubevirtv1.AddVolumeOptions {
	o := &kubevirtv1.AddVolumeOptions{Name: name,
		Disk: &kubevirtv1.Disk{Name: name, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: bus}}},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: name}}}}
	if dryRun {
		o.DryRun = []string{metav1.DryRunAll}
	}
	return o
}

// hotplugged reports whether spec has name as a hotpluggable volume with a
// SCSI disk.
func hotplugged(spec *kubevirtv1.VirtualMachineInstanceSpec, name string) bool {
	vol, disk := false, false
	for _, v := range spec.Volumes {
		vol = vol || (v.Name == name && v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.Hotpluggable)
	}
	for _, d := range spec.Domain.Devices.Disks {
		disk = disk || (d.Name == name && d.Disk != nil && d.Disk.Bus == kubevirtv1.DiskBusSCSI)
	}
	return vol && disk
}

// TestAddRemoveVolume drives addvolume and removevolume on a VMI
// (ephemeral: the VM's template keeps its volumes) and on a VM (persist:
// the template and the running VMI change), with virt-api's refusals, a
// dry run that changes nothing, the placement of a claim waiting for its
// first consumer on the VMI's node, and the refusal of a volume on another
// node.
func TestAddRemoveVolume(t *testing.T) {
	setup(t)
	ctx := context.Background()
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	kube := cp.Clientset(t)
	c := adminIn(t, ns)
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	class := "hotplug-wffc-" + ns
	if _, err := kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: class},
		Provisioner: "kubevirt.io.hostpath-provisioner", VolumeBindingMode: &wffc}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kube.StorageV1().StorageClasses().Delete(context.Background(), class, metav1.DeleteOptions{}) })
	claimOn(t, ns, "local", nodeName, "")
	claimOn(t, ns, "far", "other-node", "")
	claimOn(t, ns, "later", "-", class)
	newVM(t, ns, "hp", kubevirtv1.RunStrategyAlways)
	newVMI(t, ns, "hp", kubevirtv1.Running)
	vmiSpec := func() *kubevirtv1.VirtualMachineInstanceSpec {
		vmi, err := env.virt.VMIs.Get(ctx, ns, "hp")
		if err != nil {
			t.Fatal(err)
		}
		return &vmi.Spec
	}
	vmSpec := func() *kubevirtv1.VirtualMachineInstanceSpec {
		vm, err := env.virt.VMs.Get(ctx, ns, "hp")
		if err != nil {
			t.Fatal(err)
		}
		return &vm.Spec.Template.Spec
	}

	// Refusals before anything changes.
	wantStatus(t, "no name", c.VMI(ctx, "hp", "addvolume", &kubevirtv1.AddVolumeOptions{}), http.StatusBadRequest, "AddVolumeOptions requires name to be set")
	wantStatus(t, "virtio bus", c.VMI(ctx, "hp", "addvolume", addOpts("local", kubevirtv1.DiskBusVirtio, false)), http.StatusBadRequest, "scsi bus only")
	wantStatus(t, "other node", c.VMI(ctx, "hp", "addvolume", addOpts("far", kubevirtv1.DiskBusSCSI, false)), http.StatusBadRequest,
		"persistentvolumeclaim far is on node other-node and the VMI runs on node "+nodeName)
	wantStatus(t, "missing claim", c.VMI(ctx, "hp", "addvolume", addOpts("nothere", kubevirtv1.DiskBusSCSI, false)), http.StatusBadRequest,
		"persistentvolumeclaim nothere does not exist")
	wantStatus(t, "remove missing", c.VMI(ctx, "hp", "removevolume", &kubevirtv1.RemoveVolumeOptions{Name: "local"}), http.StatusConflict,
		"Unable to remove volume [local] because it does not exist")
	if err := c.VMI(ctx, "hp", "addvolume", addOpts("local", kubevirtv1.DiskBusSCSI, true)); err != nil {
		t.Fatalf("dry run: %v", err)
	}
	if hotplugged(vmiSpec(), "local") {
		t.Fatal("a dry run changed the VMI")
	}

	// Ephemeral: the VMI only.
	if err := c.VMI(ctx, "hp", "addvolume", addOpts("local", "", false)); err != nil {
		t.Fatalf("addvolume: %v", err)
	}
	if !hotplugged(vmiSpec(), "local") || hotplugged(vmSpec(), "local") {
		t.Fatalf("after vmi addvolume: vmi %+v, vm template %+v", vmiSpec().Volumes, vmSpec().Volumes)
	}
	wantStatus(t, "twice", c.VMI(ctx, "hp", "addvolume", addOpts("local", kubevirtv1.DiskBusSCSI, false)), http.StatusConflict,
		"Unable to add volume [local] because volume with that name already exists")

	// Persisted: the template and the VMI; the waiting claim is placed on
	// the VMI's node.
	if err := c.VM(ctx, "hp", "addvolume", addOpts("later", kubevirtv1.DiskBusSCSI, false)); err != nil {
		t.Fatalf("vm addvolume: %v", err)
	}
	if !hotplugged(vmiSpec(), "later") || !hotplugged(vmSpec(), "later") {
		t.Fatalf("after vm addvolume: vmi %+v, vm template %+v", vmiSpec().Volumes, vmSpec().Volumes)
	}
	pvc, err := kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "later", metav1.GetOptions{})
	if err != nil || pvc.Annotations[importstate.AnnSelectedNode] != nodeName {
		t.Fatalf("claim later: %v %v", pvc.Annotations, err)
	}

	if err := c.VM(ctx, "hp", "removevolume", &kubevirtv1.RemoveVolumeOptions{Name: "later"}); err != nil {
		t.Fatalf("vm removevolume: %v", err)
	}
	if hotplugged(vmiSpec(), "later") || hotplugged(vmSpec(), "later") {
		t.Fatal("vm removevolume left the volume")
	}
	if err := c.VMI(ctx, "hp", "removevolume", &kubevirtv1.RemoveVolumeOptions{Name: "local", DryRun: []string{metav1.DryRunAll}}); err != nil || !hotplugged(vmiSpec(), "local") {
		t.Fatalf("dry-run removevolume: %v", err)
	}
	if err := c.VMI(ctx, "hp", "removevolume", &kubevirtv1.RemoveVolumeOptions{Name: "local"}); err != nil || hotplugged(vmiSpec(), "local") {
		t.Fatalf("vmi removevolume: %v", err)
	}

	// A stopped VM: the template alone.
	newVM(t, ns, "cold", kubevirtv1.RunStrategyHalted)
	if err := c.VM(ctx, "cold", "addvolume", addOpts("far", kubevirtv1.DiskBusSCSI, false)); err != nil {
		t.Fatalf("addvolume on a stopped vm: %v", err)
	}
	vm, err := env.virt.VMs.Get(ctx, ns, "cold")
	if err != nil || !hotplugged(&vm.Spec.Template.Spec, "far") {
		t.Fatalf("stopped vm template: %v", err)
	}
	wantStatus(t, "vmi of a stopped vm", c.VMI(ctx, "cold", "addvolume", addOpts("local", kubevirtv1.DiskBusSCSI, false)), http.StatusNotFound, "")
}

// TestFreezeUnfreeze: freeze carries its unfreezeTimeout to the VMI's node;
// a VMI without a guest agent, one not running, a missing or negative
// timeout are refused before the node is asked.
func TestFreezeUnfreeze(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)
	newVMI(t, ns, "agent", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceAgentConnected)
	newVMI(t, ns, "noagent", kubevirtv1.Running)
	newVMI(t, ns, "pending", kubevirtv1.Pending, kubevirtv1.VirtualMachineInstanceAgentConnected)
	timeout := func(d string) *kubevirtv1.FreezeUnfreezeTimeout {
		dur, err := time.ParseDuration(d)
		if err != nil {
			t.Fatal(err)
		}
		return &kubevirtv1.FreezeUnfreezeTimeout{UnfreezeTimeout: &metav1.Duration{Duration: dur}}
	}
	if err := c.VMI(ctx, "agent", "freeze", timeout("90s")); err != nil {
		t.Fatalf("freeze: %v", err)
	}
	if err := c.VMI(ctx, "agent", "unfreeze", nil); err != nil {
		t.Fatalf("unfreeze: %v", err)
	}
	calls := strings.Join(env.node.called(), ",")
	for _, want := range []string{"PUT " + ns + "/agent/freeze", "PUT " + ns + "/agent/unfreeze"} {
		if !strings.Contains(calls, want) {
			t.Errorf("node saw %s, missing %s", calls, want)
		}
	}
	env.node.mu.Lock()
	bodies := strings.Join(env.node.bodies, ",")
	env.node.mu.Unlock()
	if !strings.Contains(bodies, ns+`/agent/freeze {"unfreezeTimeout":"1m30s"}`) {
		t.Errorf("node got freeze bodies %s", bodies)
	}
	wantStatus(t, "no timeout", c.VMI(ctx, "agent", "freeze", &kubevirtv1.FreezeUnfreezeTimeout{}), http.StatusBadRequest, "unfreezeTimeout")
	wantStatus(t, "negative", c.VMI(ctx, "agent", "freeze", timeout("-1s")), http.StatusBadRequest, "negative")
	wantStatus(t, "no agent", c.VMI(ctx, "noagent", "freeze", timeout("1m")), http.StatusConflict, "VMI does not have guest agent connected")
	wantStatus(t, "not running", c.VMI(ctx, "pending", "unfreeze", nil), http.StatusConflict, "VMI is not running")
	if strings.Contains(strings.Join(env.node.called(), ","), "/noagent/freeze") {
		t.Error("a refused freeze reached the node")
	}
}

// With declarative hotplug (DeclarativeHotplugVolumes, as virt-api): a VMI
// a VM owns takes no ephemeral volume, and a VM's addvolume and
// removevolume change its template only (the VM controller plugs), still
// placing a waiting claim on the VMI's node. A VMI of its own still takes
// ephemeral volumes.
func TestAddVolumeDeclarative(t *testing.T) {
	setup(t)
	env.rollout.Set(rollout.Cluster{DeclarativeHotplug: true})
	t.Cleanup(func() { env.rollout.Set(rollout.FromKubeVirt(nil)) })
	ctx := context.Background()
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	kube := cp.Clientset(t)
	c := adminIn(t, ns)
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	class := "hotplug-decl-" + ns
	if _, err := kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: class},
		Provisioner: "kubevirt.io.hostpath-provisioner", VolumeBindingMode: &wffc}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kube.StorageV1().StorageClasses().Delete(context.Background(), class, metav1.DeleteOptions{}) })
	claimOn(t, ns, "local", nodeName, "")
	claimOn(t, ns, "later", "-", class)
	vm := newVM(t, ns, "owned", kubevirtv1.RunStrategyAlways)
	vmi := newVMI(t, ns, "owned", kubevirtv1.Running)
	vmi.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(vm, kubevirtv1.VirtualMachineGroupVersionKind)}
	if _, err := env.virt.VMIs.Update(ctx, vmi); err != nil {
		t.Fatal(err)
	}
	newVMI(t, ns, "alone", kubevirtv1.Running)

	wantStatus(t, "ephemeral on a VM's VMI", c.VMI(ctx, "owned", "addvolume", addOpts("local", "", false)), http.StatusBadRequest,
		"VMI "+ns+"/owned is owned by a VM")
	if err := c.VMI(ctx, "alone", "addvolume", addOpts("local", "", false)); err != nil {
		t.Fatalf("ephemeral on a VMI of its own: %v", err)
	}

	if err := c.VM(ctx, "owned", "addvolume", addOpts("later", kubevirtv1.DiskBusSCSI, false)); err != nil {
		t.Fatalf("vm addvolume: %v", err)
	}
	got, err := env.virt.VMs.Get(ctx, ns, "owned")
	if err != nil || !hotplugged(&got.Spec.Template.Spec, "later") {
		t.Fatalf("vm template after addvolume: %v", err)
	}
	cur, err := env.virt.VMIs.Get(ctx, ns, "owned")
	if err != nil || hotplugged(&cur.Spec, "later") {
		t.Fatalf("the subresource patched the VMI itself (the VM controller's job): %v", err)
	}
	pvc, err := kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "later", metav1.GetOptions{})
	if err != nil || pvc.Annotations[importstate.AnnSelectedNode] != nodeName {
		t.Fatalf("claim later not placed on the VMI's node: %v %v", pvc.Annotations, err)
	}
	if err := c.VM(ctx, "owned", "removevolume", &kubevirtv1.RemoveVolumeOptions{Name: "later"}); err != nil {
		t.Fatalf("vm removevolume: %v", err)
	}
	if got, err = env.virt.VMs.Get(ctx, ns, "owned"); err != nil || hotplugged(&got.Spec.Template.Spec, "later") {
		t.Fatalf("vm template after removevolume: %v", err)
	}
}
