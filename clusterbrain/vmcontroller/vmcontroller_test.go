package vmcontroller

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

type env struct {
	t    *testing.T
	kube kubernetes.Interface
	virt *client.Set
	ns   string
}

func setup(t *testing.T, edits ...func(*Config)) env {
	t.Helper()
	e := newEnv(t)
	cfg := Config{RestConfig: controlplane.Shared(t).RestConfig, BackoffBase: time.Second, BackoffMax: 2 * time.Second,
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	for _, edit := range edits {
		edit(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return e
}

// newEnv makes the clients and namespace of a test, without a controller.
func newEnv(t *testing.T) env {
	t.Helper()
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	rc := rest.CopyConfig(cp.RestConfig)
	rc.QPS, rc.Burst = 500, 1000 // the test polls fast; do not starve it
	virt, err := client.NewSet(rc)
	if err != nil {
		t.Fatal(err)
	}
	return env{t: t, kube: cp.Clientset(t), virt: virt, ns: cp.Namespace(t)}
}

func strategy(s kubevirtv1.VirtualMachineRunStrategy) *kubevirtv1.VirtualMachineRunStrategy {
	return &s
}

func (e env) newVM(name string, edit func(*kubevirtv1.VirtualMachine)) *kubevirtv1.VirtualMachine {
	e.t.Helper()
	mem := resource.MustParse("64Mi")
	vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: strategy(kubevirtv1.RunStrategyAlways),
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": name}},
				Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{
					Memory:  &kubevirtv1.Memory{Guest: &mem},
					Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{Name: "root"}}}},
					Volumes: []kubevirtv1.Volume{{Name: "root", VolumeSource: kubevirtv1.VolumeSource{
						ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "example/disk"}}}}}}}}
	if edit != nil {
		edit(vm)
	}
	got, err := e.virt.VMs.Create(context.Background(), vm)
	if err != nil {
		e.t.Fatal(err)
	}
	return got
}

// waitVM polls the VM (and its VMI, nil when absent) until cond holds.
func (e env) waitVM(name, what string, cond func(*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) bool) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) {
	e.t.Helper()
	var vm *kubevirtv1.VirtualMachine
	var vmi *kubevirtv1.VirtualMachineInstance
	var getErr error
	testkit.Poll(e.t, 15*time.Second, fmt.Sprintf("vm %s: %s", name, what), func() (bool, error) {
		ctx := context.Background()
		var err error
		if vm, err = e.virt.VMs.Get(ctx, e.ns, name); err != nil {
			getErr = err
			return false, fmt.Errorf("last get error %v", getErr)
		}
		vmi = nil
		if v, err := e.virt.VMIs.Get(ctx, e.ns, name); err == nil {
			vmi = v
		}
		s := "<nil>"
		if vmi != nil {
			s = string(vmi.Status.Phase)
		}
		return cond(vm, vmi), fmt.Errorf("printableStatus %q, vmi %s, conditions %+v, last get error %v", vm.Status.PrintableStatus, s, vm.Status.Conditions, getErr)
	})
	return vm, vmi
}

func (e env) setVMIPhase(vmi *kubevirtv1.VirtualMachineInstance, phase kubevirtv1.VirtualMachineInstancePhase, ready bool) {
	e.t.Helper()
	cur, err := e.virt.VMIs.Get(context.Background(), vmi.Namespace, vmi.Name)
	if err != nil || cur.UID != vmi.UID {
		e.t.Fatalf("vmi %s gone: %v", vmi.Name, err)
	}
	vmi = cur
	vmi.Status.Phase = phase
	vmi.Status.NodeName = "node-1"
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	vmi.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstanceReady, Status: st}}
	if _, err := e.virt.VMIs.UpdateStatus(context.Background(), vmi); err != nil {
		e.t.Fatal(err)
	}
}

func (e env) patchVM(name string, patch string) {
	e.t.Helper()
	if _, err := e.virt.VMs.Patch(context.Background(), e.ns, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

func (e env) request(name string, reqs ...kubevirtv1.VirtualMachineStateChangeRequest) {
	e.t.Helper()
	data, _ := json.Marshal(map[string]any{"status": map[string]any{"stateChangeRequests": reqs}})
	if _, err := e.virt.VMs.Patch(context.Background(), e.ns, name, types.MergePatchType, data, metav1.PatchOptions{}, "status"); err != nil {
		e.t.Fatal(err)
	}
}

func status(s kubevirtv1.VirtualMachinePrintableStatus) func(*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) bool {
	return func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm.Status.PrintableStatus == s
	}
}

func noVMI(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
	return vmi == nil && vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStopped
}

func TestAlwaysRunsReportsAndRestartsWithBackoff(t *testing.T) {
	e := setup(t)
	vm := e.newVM("always", nil)
	_, vmi := e.waitVM("always", "vmi created", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil && vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStarting
	})
	ref := metav1.GetControllerOf(vmi)
	if ref == nil || ref.UID != vm.UID || ref.Kind != "VirtualMachine" || ref.BlockOwnerDeletion == nil || !*ref.BlockOwnerDeletion {
		t.Errorf("vmi owner %+v", vmi.OwnerReferences)
	}
	if vmi.Labels["app"] != "always" {
		t.Errorf("template labels not copied: %v", vmi.Labels)
	}
	e.setVMIPhase(vmi, kubevirtv1.Running, true)
	got, _ := e.waitVM("always", "running and ready", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusRunning && vm.Status.Ready
	})
	if !got.Status.Created || got.Status.RunStrategy != kubevirtv1.RunStrategyAlways {
		t.Errorf("status %+v", got.Status)
	}
	// A failure restarts it after a back-off, counting failures.
	failedAt := time.Now() // before the write: the controller sees the failure after it
	e.setVMIPhase(vmi, kubevirtv1.Failed, false)
	got, _ = e.waitVM("always", "crash loop", status(kubevirtv1.VirtualMachineStatusCrashLoopBackOff))
	if f := got.Status.StartFailure; f == nil || f.ConsecutiveFailCount != 1 || f.LastFailedVMIUID != vmi.UID {
		t.Errorf("start failure %+v", got.Status.StartFailure)
	}
	_, second := e.waitVM("always", "restarted", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID != vmi.UID
	})
	if d := time.Since(failedAt); d < 900*time.Millisecond {
		t.Errorf("restarted after %s, before the 1s back-off", d)
	}
	e.setVMIPhase(second, kubevirtv1.Failed, false)
	got, _ = e.waitVM("always", "second failure counted", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm.Status.StartFailure != nil && vm.Status.StartFailure.ConsecutiveFailCount == 2
	})
	if f := got.Status.StartFailure; f.RetryAfterTimestamp.Sub(failedAt) < 2*time.Second {
		t.Errorf("second back-off too short: retry at %s", f.RetryAfterTimestamp)
	}
	// A Running VMI clears the failures.
	_, third := e.waitVM("always", "restarted again", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID != second.UID && v.UID != vmi.UID
	})
	e.setVMIPhase(third, kubevirtv1.Running, true)
	e.waitVM("always", "failures cleared", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm.Status.StartFailure == nil && vm.Status.Ready
	})
	// Halted stops it.
	e.patchVM("always", `{"spec":{"runStrategy":"Halted"}}`)
	e.waitVM("always", "stopped", noVMI)
}

func TestManualHonoursStateChangeRequests(t *testing.T) {
	e := setup(t)
	e.newVM("manual", func(vm *kubevirtv1.VirtualMachine) { vm.Spec.RunStrategy = strategy(kubevirtv1.RunStrategyManual) })
	time.Sleep(500 * time.Millisecond)
	e.waitVM("manual", "stays stopped", noVMI)
	e.request("manual", kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StartRequest})
	vm, vmi := e.waitVM("manual", "started", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil && len(vm.Status.StateChangeRequests) == 0
	})
	_ = vm
	e.setVMIPhase(vmi, kubevirtv1.Running, true)
	e.waitVM("manual", "running", status(kubevirtv1.VirtualMachineStatusRunning))
	// Restart: Stop(uid) then Start.
	uid := vmi.UID
	e.request("manual", kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StopRequest, UID: &uid},
		kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StartRequest})
	e.waitVM("manual", "restarted", func(vm *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID != uid && len(vm.Status.StateChangeRequests) == 0
	})
	// A VMI that ends stays (Manual never restarts on its own).
	_, vmi = e.waitVM("manual", "vmi", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	e.setVMIPhase(vmi, kubevirtv1.Succeeded, false)
	e.waitVM("manual", "stopped with its vmi kept", func(vm *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID == vmi.UID && vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStopped
	})
	uid = vmi.UID
	e.request("manual", kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StopRequest, UID: &uid})
	e.waitVM("manual", "stop removes the vmi", func(vm *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v == nil && len(vm.Status.StateChangeRequests) == 0
	})
}

func TestRerunOnFailureOnceAndLegacyRunning(t *testing.T) {
	e := setup(t)
	e.newVM("rerun", func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.RunStrategy = strategy(kubevirtv1.RunStrategyRerunOnFailure)
	})
	_, vmi := e.waitVM("rerun", "started", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	e.setVMIPhase(vmi, kubevirtv1.Failed, false)
	_, again := e.waitVM("rerun", "rerun after failure", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID != vmi.UID
	})
	e.setVMIPhase(again, kubevirtv1.Succeeded, false)
	time.Sleep(1500 * time.Millisecond)
	e.waitVM("rerun", "success is final", func(vm *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID == again.UID && vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStopped
	})

	e.newVM("once", func(vm *kubevirtv1.VirtualMachine) { vm.Spec.RunStrategy = strategy(kubevirtv1.RunStrategyOnce) })
	_, vmi = e.waitVM("once", "started", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	e.setVMIPhase(vmi, kubevirtv1.Failed, false)
	time.Sleep(1500 * time.Millisecond)
	e.waitVM("once", "not restarted", func(vm *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID == vmi.UID && vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStopped
	})

	yes := true
	e.newVM("legacy", func(vm *kubevirtv1.VirtualMachine) { vm.Spec.RunStrategy, vm.Spec.Running = nil, &yes })
	e.waitVM("legacy", "running: true starts", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	e.patchVM("legacy", `{"spec":{"running":false}}`)
	e.waitVM("legacy", "running: false stops", noVMI)
}

func TestInstancetypeExpansion(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	itName := e.ns + "-small"
	it := &instancetypev1beta1.VirtualMachineClusterInstancetype{ObjectMeta: metav1.ObjectMeta{Name: itName},
		Spec: instancetypev1beta1.VirtualMachineInstancetypeSpec{CPU: instancetypev1beta1.CPUInstancetype{Guest: 2},
			Memory: instancetypev1beta1.MemoryInstancetype{Guest: resource.MustParse("1Gi")}}}
	if _, err := e.virt.ClusterInstancetypes.Create(ctx, it); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.virt.ClusterInstancetypes.Delete(ctx, "", itName, metav1.DeleteOptions{}) })
	cores := instancetypev1beta1.Cores
	pref := &instancetypev1beta1.VirtualMachinePreference{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "sata"},
		Spec: instancetypev1beta1.VirtualMachinePreferenceSpec{
			CPU:     &instancetypev1beta1.CPUPreferences{PreferredCPUTopology: &cores},
			Devices: &instancetypev1beta1.DevicePreferences{PreferredDiskBus: kubevirtv1.DiskBusSATA}}}
	if _, err := e.virt.Preferences.Create(ctx, pref); err != nil {
		t.Fatal(err)
	}
	typed := func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.Template.Spec.Domain.Memory = nil
		vm.Spec.Instancetype = &kubevirtv1.InstancetypeMatcher{Name: itName}
		vm.Spec.Preference = &kubevirtv1.PreferenceMatcher{Name: "sata", Kind: "VirtualMachinePreference"}
	}
	e.newVM("typed", typed)
	vm, vmi := e.waitVM("typed", "expanded vmi", func(vm *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	itRev, prefRev := vm.Spec.Instancetype.RevisionName, vm.Spec.Preference.RevisionName
	if itRev == "" || prefRev == "" {
		t.Fatalf("revision names not recorded: %+v %+v", vm.Spec.Instancetype, vm.Spec.Preference)
	}
	for _, rev := range []string{itRev, prefRev} {
		cr, err := e.kube.AppsV1().ControllerRevisions(e.ns).Get(ctx, rev, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("revision %s: %v", rev, err)
		}
		if ref := metav1.GetControllerOf(cr); ref == nil || ref.UID != vm.UID {
			t.Errorf("revision %s not owned by the vm", rev)
		}
	}
	d := vmi.Spec.Domain
	if d.CPU == nil || d.CPU.Cores != 2 || d.CPU.Sockets != 1 || d.Memory == nil || d.Memory.Guest.String() != "1Gi" {
		t.Errorf("instancetype not applied: cpu %+v memory %+v", d.CPU, d.Memory)
	}
	if d.Devices.Disks[0].Disk == nil || d.Devices.Disks[0].Disk.Bus != kubevirtv1.DiskBusSATA {
		t.Errorf("preference not applied: %+v", d.Devices.Disks[0])
	}

	// Editing the type changes neither this VM nor its next VMI.
	it, _ = e.virt.ClusterInstancetypes.Get(ctx, "", itName)
	it.Spec.CPU.Guest = 4
	if _, err := e.virt.ClusterInstancetypes.Update(ctx, it); err != nil {
		t.Fatal(err)
	}
	e.setVMIPhase(vmi, kubevirtv1.Succeeded, false)
	_, next := e.waitVM("typed", "restarted", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && v.UID != vmi.UID
	})
	if next.Spec.Domain.CPU.Cores != 2 {
		t.Errorf("restarted vmi has %d cores, want the frozen 2", next.Spec.Domain.CPU.Cores)
	}
	// A new VM gets the edited type.
	e.newVM("typed-later", typed)
	_, later := e.waitVM("typed-later", "expanded", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	if later.Spec.Domain.CPU.Cores != 4 {
		t.Errorf("new vm has %d cores, want 4", later.Spec.Domain.CPU.Cores)
	}

	// A template that sets what the type owns is refused.
	e.newVM("conflict", func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.Instancetype = &kubevirtv1.InstancetypeMatcher{Name: itName}
	})
	vm, _ = e.waitVM("conflict", "failure condition", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		for _, c := range vm.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineFailure && strings.Contains(c.Message, "spec.template.spec.domain.memory.guest") &&
				strings.Contains(c.Message, "VM field conflicts with selected instance type") {
				return true
			}
		}
		return false
	})
	if _, err := e.virt.VMIs.Get(ctx, e.ns, "conflict"); err == nil {
		t.Error("vmi created despite the conflict")
	}
}

func TestDataVolumeTemplates(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	vm := e.newVM("withdv", func(vm *kubevirtv1.VirtualMachine) {
		vm.Spec.DataVolumeTemplates = []kubevirtv1.DataVolumeTemplateSpec{{
			ObjectMeta: metav1.ObjectMeta{Name: "withdv-root"},
			Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}},
				Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}}}
		vm.Spec.Template.Spec.Volumes[0].VolumeSource = kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: "withdv-root"}}
	})
	e.waitVM("withdv", "provisioning", status(kubevirtv1.VirtualMachineStatusProvisioning))
	dv, err := e.virt.DataVolumes.Get(ctx, e.ns, "withdv-root")
	if err != nil {
		t.Fatal(err)
	}
	if ref := metav1.GetControllerOf(dv); ref == nil || ref.UID != vm.UID {
		t.Errorf("datavolume owner %+v", dv.OwnerReferences)
	}
	if _, err := e.virt.VMIs.Get(ctx, e.ns, "withdv"); err == nil {
		t.Error("vmi created before its datavolume is ready")
	}
	setDV := func(phase cdiv1.DataVolumePhase) {
		dv, _ := e.virt.DataVolumes.Get(ctx, e.ns, "withdv-root")
		dv.Status.Phase = phase
		if _, err := e.virt.DataVolumes.UpdateStatus(ctx, dv); err != nil {
			t.Fatal(err)
		}
	}
	setDV(cdiv1.Failed)
	e.waitVM("withdv", "datavolume error", status(kubevirtv1.VirtualMachineStatusDataVolumeError))
	setDV(cdiv1.WaitForFirstConsumer)
	e.waitVM("withdv", "vmi created for the first consumer", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	// The scheduler's verdict shows.
	_, vmi := e.waitVM("withdv", "vmi", func(_ *kubevirtv1.VirtualMachine, v *kubevirtv1.VirtualMachineInstance) bool { return v != nil })
	vmi.Status.Phase = kubevirtv1.Pending
	vmi.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: "PodScheduled", Status: corev1.ConditionFalse,
		Reason: "Unschedulable", Message: "0/1 nodes are available: 1 insufficient memory."}}
	if _, err := e.virt.VMIs.UpdateStatus(ctx, vmi); err != nil {
		t.Fatal(err)
	}
	e.waitVM("withdv", "unschedulable", status(kubevirtv1.VirtualMachineStatusUnschedulable))
}
