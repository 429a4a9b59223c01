// Package fuzz holds the fuzz targets of the brain's admission validation
// (VMs, VMIs, DataVolumes, VMI updates, quota accounting). They live apart
// from package admission, whose tests start a control plane that every fuzz
// worker would start again. Seeds are in testdata/fuzz/<target>; plain
// `go test` runs the seeds, `go test -fuzz=<target>` explores.
package fuzz

import (
	"bytes"
	"encoding/json"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
)

// roundTrip encodes v, decodes the result into a fresh value and encodes
// that again: both encodings must be equal (what the API server stores
// after admission must mean what was admitted).
func roundTrip[T any](t *testing.T, v *T) *T {
	t.Helper()
	first, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("encode: %v", err)
	}
	var back T
	if err := json.Unmarshal(first, &back); err != nil {
		t.Fatalf("decode what was encoded: %v\n%s", err, first)
	}
	second, err := json.Marshal(&back)
	if err != nil {
		t.Fatalf("encode again: %v", err)
	}
	if !bytes.Equal(first, second) {
		t.Fatalf("round trip changed the object:\n%s\n%s", first, second)
	}
	return &back
}

func noGates(string) bool { return false }

// FuzzValidateVMI: any JSON a user sends as a VMI is validated without a
// panic; an accepted spec round-trips and stays accepted; the defaults
// settle in one pass and keep an accepted spec accepted; usage and
// LimitRange defaulting never panic.
func FuzzValidateVMI(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		var vmi kubevirtv1.VirtualMachineInstance
		if json.Unmarshal(data, &vmi) != nil {
			return
		}
		spec := field.NewPath("spec")
		errs := admission.ValidateVMISpec(spec, &vmi.Spec, false)
		errs = append(errs, admission.ValidateFeatureGates(spec, &vmi.Spec, noGates)...)
		_ = admission.VMIUsage(&vmi, 10)
		lr := &corev1.LimitRange{Spec: corev1.LimitRangeSpec{Limits: []corev1.LimitRangeItem{{Type: corev1.LimitTypeContainer,
			Default: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")},
			Max:     corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("2Gi")}}}}}
		_, _ = admission.ApplyLimitRanges(vmi.Spec.DeepCopy(), []*corev1.LimitRange{lr})
		if len(errs) > 0 {
			return
		}
		back := roundTrip(t, &vmi)
		if errs := admission.ValidateVMISpec(spec, &back.Spec, false); len(errs) > 0 {
			t.Fatalf("accepted spec refused after a round trip: %v", errs)
		}
		defaulted := vmi.Spec.DeepCopy()
		admission.DefaultVMISpec(defaulted)
		once, _ := json.Marshal(defaulted)
		admission.DefaultVMISpec(defaulted)
		twice, _ := json.Marshal(defaulted)
		if !bytes.Equal(once, twice) {
			t.Fatalf("defaults did not settle in one pass:\n%s\n%s", once, twice)
		}
		if errs := admission.ValidateVMISpec(spec, defaulted, false); len(errs) > 0 {
			t.Fatalf("defaults made an accepted spec invalid: %v\n%s", errs, once)
		}
	})
}

// FuzzValidateVM: any JSON sent as a VM is validated without a panic; an
// accepted VM round-trips and stays accepted.
func FuzzValidateVM(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		var vm kubevirtv1.VirtualMachine
		if json.Unmarshal(data, &vm) != nil {
			return
		}
		errs := admission.ValidateVM(&vm)
		if vm.Spec.Template != nil {
			errs = append(errs, admission.ValidateFeatureGates(field.NewPath("spec", "template", "spec"), &vm.Spec.Template.Spec, noGates)...)
		}
		if len(errs) > 0 {
			return
		}
		back := roundTrip(t, &vm)
		if errs := admission.ValidateVM(back); len(errs) > 0 {
			t.Fatalf("accepted vm refused after a round trip: %v", errs)
		}
	})
}

// FuzzValidateDataVolume: any JSON sent as a DataVolume is validated
// without a panic; an accepted spec round-trips and stays accepted.
func FuzzValidateDataVolume(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		var dv cdiv1.DataVolume
		if json.Unmarshal(data, &dv) != nil {
			return
		}
		spec := field.NewPath("spec")
		if errs := admission.ValidateDataVolumeSpec(spec, &dv.Spec); len(errs) > 0 {
			return
		}
		back := roundTrip(t, &dv)
		if errs := admission.ValidateDataVolumeSpec(spec, &back.Spec); len(errs) > 0 {
			t.Fatalf("accepted datavolume refused after a round trip: %v", errs)
		}
	})
}

// FuzzVMIUpdate: a user's update of a VMI (old and new as JSON) is judged
// without a panic, an unchanged VMI is always allowed, and a VMI whose
// node label differs is always refused.
func FuzzVMIUpdate(f *testing.F) {
	f.Fuzz(func(t *testing.T, oldData, newData []byte) {
		var old, cur kubevirtv1.VirtualMachineInstance
		if json.Unmarshal(oldData, &old) != nil || json.Unmarshal(newData, &cur) != nil {
			return
		}
		if errs := admission.ValidateVMIUpdate(&old, old.DeepCopy()); len(errs) > 0 {
			t.Fatalf("an unchanged vmi was refused: %v", errs)
		}
		errs := admission.ValidateVMIUpdate(&old, &cur)
		on, oOK := old.Labels[kubevirtv1.NodeNameLabel]
		cn, cOK := cur.Labels[kubevirtv1.NodeNameLabel]
		if (on != cn || oOK != cOK) && len(errs) == 0 {
			t.Fatalf("node label changed from %q to %q and admitted", on, cn)
		}
	})
}

// FuzzQuota: quota checks over fuzzed VMIs never panic, and a VMI is
// never admitted when what it asks for alone exceeds a hard limit.
func FuzzQuota(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte, hardMi uint16) {
		var vmi kubevirtv1.VirtualMachineInstance
		if json.Unmarshal(data, &vmi) != nil {
			return
		}
		hard := *resource.NewQuantity(int64(hardMi)<<20, resource.BinarySI)
		rq := &corev1.ResourceQuota{}
		rq.Name = "q"
		rq.Spec.Hard = corev1.ResourceList{corev1.ResourceRequestsMemory: hard}
		err := admission.CheckQuotas([]*corev1.ResourceQuota{rq}, &vmi, []*kubevirtv1.VirtualMachineInstance{vmi.DeepCopy()}, 10)
		usage := admission.VMIUsage(&vmi, 10)
		if m, ok := usage[corev1.ResourceRequestsMemory]; ok && m.Cmp(hard) > 0 && err == nil {
			t.Fatalf("vmi asking %s admitted under %s", m.String(), hard.String())
		}
	})
}
