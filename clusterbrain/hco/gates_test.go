package hco

import (
	"reflect"
	"slices"
	"testing"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// allGatesOn is a defaulted HyperConverged asking for every feature gate
// its API has.
func allGatesOn(t *testing.T) *hcov1beta1.HyperConverged {
	t.Helper()
	hc := &hcov1beta1.HyperConverged{}
	hc.Name, hc.Namespace = hcov1beta1.Name, "kubevirt-hyperconverged"
	SetDefaults(hc)
	fg := reflect.ValueOf(&hc.Spec.FeatureGates).Elem()
	yes := true
	for i := range fg.NumField() {
		if f := fg.Field(i); f.Type() == reflect.TypeOf(&yes) {
			f.Set(reflect.ValueOf(&yes))
		}
	}
	return hc
}

// Every gate a rendered KubeVirt or CDI CR advertises gates something
// nodevirt does, whatever the HyperConverged asks for.
func TestRenderedGatesAreImplemented(t *testing.T) {
	for _, emulate := range []bool{false, true} {
		hc := allGatesOn(t)
		if emulate {
			hc.Annotations = map[string]string{hcov1beta1.UseEmulationAnnotation: "true"}
		}
		c, err := Render(hc, "test")
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range c.KubeVirt.Spec.Configuration.DeveloperConfiguration.FeatureGates {
			if !slices.Contains(featuregate.KubeVirtImplemented, g) {
				t.Errorf("KubeVirt CR advertises %s, which nodevirt does not implement", g)
			}
		}
		for _, g := range c.CDI.Spec.Config.FeatureGates {
			if !slices.Contains(featuregate.CDIImplemented, g) {
				t.Errorf("CDI CR advertises %s, which nodevirt does not implement", g)
			}
		}
		if featuregate.KubeVirtEnabled(c.KubeVirt, featuregate.HostDisk) {
			t.Error("HostDisk is on without the administrator asking")
		}
	}
}

// An administrator turns HostDisk on as upstream documents it: HCO's
// KubeVirt JSON-patch annotation appending to the gate list, which works
// even when nodevirt renders no gate.
func TestHostDiskGateThroughJSONPatch(t *testing.T) {
	hc := &hcov1beta1.HyperConverged{}
	hc.Name, hc.Namespace = hcov1beta1.Name, "kubevirt-hyperconverged"
	SetDefaults(hc)
	hc.Annotations = map[string]string{hcov1beta1.JSONPatchKubeVirtAnnotation: `[{"op":"add","path":"/spec/configuration/developerConfiguration/featureGates/-","value":"HostDisk"}]`}
	c, err := Render(hc, "test")
	if err != nil {
		t.Fatal(err)
	}
	if !featuregate.KubeVirtEnabled(c.KubeVirt, featuregate.HostDisk) {
		t.Errorf("HostDisk not on: %v", c.KubeVirt.Spec.Configuration.DeveloperConfiguration.FeatureGates)
	}
}
