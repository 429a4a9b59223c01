package vmsnapshot

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"
)

func TestClaimNames(t *testing.T) {
	prefix := snapv1beta1.VolumeRestorePolicyPrefixTargetName
	r := &snapv1beta1.VirtualMachineRestore{ObjectMeta: metav1.ObjectMeta{Name: "r", UID: "u1"},
		Spec: snapv1beta1.VirtualMachineRestoreSpec{Target: corev1.TypedLocalObjectReference{Name: "vm2"},
			VolumeRestoreOverrides: []snapv1beta1.VolumeRestoreOverride{{VolumeName: "data", RestoreName: "my-data",
				Labels: map[string]string{"l": "v"}, Annotations: map[string]string{"a": "b"}}}}}
	if got := claimName(r, "root"); got != "restore-u1-root" {
		t.Errorf("RandomizeNames: %s", got)
	}
	if got := claimName(r, "data"); got != "my-data" {
		t.Errorf("override: %s", got)
	}
	r.Spec.VolumeRestorePolicy = &prefix
	if got := claimName(r, "root"); got != "vm2-root" {
		t.Errorf("PrefixTargetName: %s", got)
	}
	vs := "vs1"
	b := snapv1beta1.VolumeBackup{VolumeName: "data", VolumeSnapshotName: &vs, PersistentVolumeClaim: snapv1beta1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "old", Labels: map[string]string{"app": "x"},
			Annotations: map[string]string{"pv.kubernetes.io/bind-completed": "yes", "volume.kubernetes.io/selected-node": "n1", "keep": "1"}},
		Spec: corev1.PersistentVolumeClaimSpec{VolumeName: "pv-old"}}}
	pvc := restoredClaim(r, b, "my-data")
	if pvc.Spec.VolumeName != "" || pvc.Spec.DataSource == nil || pvc.Spec.DataSource.Name != "vs1" || pvc.Spec.DataSourceRef == nil {
		t.Errorf("restored claim spec %+v: want no volume name and the snapshot as data source", pvc.Spec)
	}
	want := map[string]string{"keep": "1", "a": "b", AnnRestoreName: "r"}
	if len(pvc.Annotations) != len(want) {
		t.Errorf("annotations %v, want %v", pvc.Annotations, want)
	}
	for k, v := range want {
		if pvc.Annotations[k] != v {
			t.Errorf("annotation %s=%q, want %q", k, pvc.Annotations[k], v)
		}
	}
	if pvc.Labels["app"] != "x" || pvc.Labels["l"] != "v" {
		t.Errorf("labels %v", pvc.Labels)
	}
}

func TestRestoredVM(t *testing.T) {
	always := kubevirtv1.RunStrategyAlways
	src := &snapv1beta1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: "vm", Labels: map[string]string{"a": "1"}},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &always,
			DataVolumeTemplates: []kubevirtv1.DataVolumeTemplateSpec{{ObjectMeta: metav1.ObjectMeta{Name: "vm-root"}}, {ObjectMeta: metav1.ObjectMeta{Name: "unrelated"}}},
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: kubevirtv1.VirtualMachineInstanceSpec{Volumes: []kubevirtv1.Volume{
				{Name: "root", VolumeSource: kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: "vm-root"}}},
				{Name: "ci", VolumeSource: kubevirtv1.VolumeSource{CloudInitNoCloud: &kubevirtv1.CloudInitNoCloudSource{UserData: "x"}}}}}}}}
	vm, err := restoredVM(src, map[string]string{"root": "restore-u-root"}, []string{`{"op":"add","path":"/metadata/labels/b","value":"2"}`})
	if err != nil {
		t.Fatal(err)
	}
	if rs := vm.Spec.RunStrategy; rs == nil || *rs != kubevirtv1.RunStrategyHalted {
		t.Errorf("run strategy %v, want Halted", rs)
	}
	v := vm.Spec.Template.Spec.Volumes
	if v[0].PersistentVolumeClaim == nil || v[0].PersistentVolumeClaim.ClaimName != "restore-u-root" || v[0].DataVolume != nil || v[1].CloudInitNoCloud == nil {
		t.Errorf("volumes %+v", v)
	}
	if len(vm.Spec.DataVolumeTemplates) != 1 || vm.Spec.DataVolumeTemplates[0].Name != "unrelated" {
		t.Errorf("templates %+v: want only the unrelated one", vm.Spec.DataVolumeTemplates)
	}
	if vm.Labels["a"] != "1" || vm.Labels["b"] != "2" {
		t.Errorf("labels %v: want the patch applied", vm.Labels)
	}
	if *src.Spec.RunStrategy != kubevirtv1.RunStrategyAlways || src.Spec.Template.Spec.Volumes[0].DataVolume == nil {
		t.Error("the content's VM was modified")
	}
	if _, err := restoredVM(src, nil, []string{`{"op":"remove","path":"/nope"}`}); err == nil {
		t.Error("a patch that cannot apply was accepted")
	}
}
