package vmclone

import (
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"

	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"
)

func TestFiltered(t *testing.T) {
	m := map[string]string{"app": "a", "example.org/team": "t", "example.org/cost": "c", "other": "o"}
	for _, tc := range []struct {
		filters []string
		want    []string
	}{
		{nil, []string{"app", "example.org/cost", "example.org/team", "other"}},
		{[]string{"*"}, []string{"app", "example.org/cost", "example.org/team", "other"}},
		{[]string{"*", "!example.org/*"}, []string{"app", "other"}},
		{[]string{"example.org/*"}, []string{"example.org/cost", "example.org/team"}},
		{[]string{"example.org/*", "!*cost"}, []string{"example.org/team"}},
		{[]string{"!app", "app"}, []string{"app"}}, // the last match decides
		{[]string{"a*p"}, []string{"app"}},
	} {
		got, err := Filtered(m, tc.filters)
		if err != nil {
			t.Fatal(err)
		}
		keys := strings.Join(slices.Sorted(maps.Keys(got)), ",")
		if want := strings.Join(tc.want, ","); keys != want {
			t.Errorf("filters %q kept %s, want %s", tc.filters, keys, want)
		}
	}
	if _, err := Filtered(m, []string{"!"}); err == nil {
		t.Error("an empty filter was accepted")
	}
}

// TestPatchesRegenerateIdentity: with no MAC or serial asked for, every
// MAC is removed (the pool allocates) and a new serial is made.
func TestPatchesRegenerateIdentity(t *testing.T) {
	src := &snapv1beta1.VirtualMachine{Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
		Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{
			Firmware: &kubevirtv1.Firmware{Serial: "s1"},
			Devices:  kubevirtv1.Devices{Interfaces: []kubevirtv1.Interface{{Name: "a", MacAddress: "02:00:00:00:00:01"}, {Name: "b"}}}}}}}}
	vc := &clonev1beta1.VirtualMachineClone{Spec: clonev1beta1.VirtualMachineCloneSpec{
		Patches: []string{`{"op":"add","path":"/metadata/labels/x","value":"y"}`}}}
	ps, err := Patches(vc, src)
	if err != nil {
		t.Fatal(err)
	}
	var ops []op
	for _, p := range ps {
		var o op
		if err := json.Unmarshal([]byte(p), &o); err != nil {
			t.Fatalf("patch %s: %v", p, err)
		}
		ops = append(ops, o)
	}
	var removedMAC, serial bool
	for _, o := range ops {
		switch {
		case o.Op == "remove" && o.Path == "/spec/template/spec/domain/devices/interfaces/0/macAddress":
			removedMAC = true
		case o.Path == "/spec/template/spec/domain/devices/interfaces/1/macAddress":
			t.Errorf("interface without a MAC patched: %+v", o)
		case o.Path == "/spec/template/spec/domain/firmware/serial":
			serial = o.Value != "s1" && o.Value != ""
		}
	}
	if !removedMAC || !serial {
		t.Errorf("patches %v: want the MAC removed and a new serial", ps)
	}
	if ps[len(ps)-1] != vc.Spec.Patches[0] {
		t.Errorf("the clone's own patch is not last: %v", ps)
	}
}
