package hcoconvert

import (
	"encoding/json"
	"os"
	"reflect"
	"testing"

	"sigs.k8s.io/yaml"
)

func load(t *testing.T, path string) Object {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var obj Object
	if err := yaml.Unmarshal(data, &obj); err != nil {
		t.Fatal(err)
	}
	return obj
}

func at(obj Object, path ...string) any {
	var cur any = obj
	for _, p := range path {
		m, ok := cur.(map[string]any)
		if !ok {
			return nil
		}
		cur = m[p]
	}
	return cur
}

func TestUpstreamSamplesConvertBothWays(t *testing.T) {
	v1 := load(t, "../../../shared/compat/hco/hco.cr.v1.yaml")
	beta := load(t, "../../../shared/compat/hco/hco.cr.v1beta1.yaml")

	got, err := ToV1beta1(v1)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path []string
		want any
	}{
		{[]string{"spec", "uninstallStrategy"}, "BlockUninstallIfWorkloadsExist"},
		{[]string{"spec", "certConfig", "ca", "duration"}, "48h0m0s"},
		{[]string{"spec", "liveMigrationConfig", "parallelMigrationsPerCluster"}, float64(5)},
		{[]string{"spec", "resourceRequirements", "vmiCPUAllocationRatio"}, float64(10)},
		{[]string{"spec", "enableCommonBootImageImport"}, true},
		{[]string{"spec", "deployVmConsoleProxy"}, false},
		{[]string{"spec", "workloadUpdateStrategy", "batchEvictionSize"}, float64(10)},
		{[]string{"metadata", "annotations", V1OnlyAnnotation}, `{"deployment":{"deployNetworkResourcesInjector":true}}`},
	} {
		if v := at(got, c.path...); !reflect.DeepEqual(v, c.want) {
			t.Errorf("v1 sample as v1beta1: %v = %#v, want %#v", c.path, v, c.want)
		}
	}
	back, err := ToV1(got)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, v1) {
		a, _ := json.Marshal(back)
		b, _ := json.Marshal(v1)
		t.Errorf("v1 → v1beta1 → v1 changed the object:\n got %s\nwant %s", a, b)
	}

	asV1, err := ToV1(beta)
	if err != nil {
		t.Fatal(err)
	}
	gates, _ := at(asV1, "spec", "featureGates").([]any)
	if len(gates) != 9 || !reflect.DeepEqual(gates[0], map[string]any{"name": "alignCPUs", "state": "Disabled"}) {
		t.Errorf("v1beta1 gates as v1: %v", gates)
	}
	if v := at(asV1, "spec", "workloadSources", "enableMultiArchBootImageImport"); v != false {
		t.Errorf("multi-arch gate moved to workloadSources: got %v", v)
	}
	if v := at(asV1, "spec", "deployment", "applicationAwareConfig", "enable"); v != false {
		t.Errorf("enableApplicationAwareQuota: got %v", v)
	}
	// infra: {} and workloads: {} are v1beta1-only (empty) fields: they
	// ride along in the annotation.
	if at(asV1, "metadata", "annotations", V1beta1OnlyAnnotation) == nil {
		t.Errorf("v1beta1-only fields not kept: %v", at(asV1, "metadata"))
	}
	again, err := ToV1beta1(asV1)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(again, beta) {
		a, _ := json.Marshal(again)
		b, _ := json.Marshal(beta)
		t.Errorf("v1beta1 → v1 → v1beta1 changed the object:\n got %s\nwant %s", a, b)
	}
}

func TestGatesOnlyV1KnowsSurvive(t *testing.T) {
	v1 := Object{"apiVersion": "hco.kubevirt.io/v1", "kind": "HyperConverged",
		"metadata": map[string]any{"name": "x"},
		"spec": map[string]any{"featureGates": []any{
			map[string]any{"name": "downwardMetrics"},
			map[string]any{"name": "someFutureGate", "state": "Enabled"},
		}}}
	beta, err := Convert(v1, "hco.kubevirt.io/v1beta1")
	if err != nil {
		t.Fatal(err)
	}
	if v := at(beta, "spec", "featureGates", "downwardMetrics"); v != true {
		t.Errorf("a gate without state is enabled: got %v", v)
	}
	back, err := Convert(beta, "hco.kubevirt.io/v1")
	if err != nil {
		t.Fatal(err)
	}
	want := []any{map[string]any{"name": "someFutureGate", "state": "Enabled"},
		map[string]any{"name": "downwardMetrics", "state": "Enabled"}}
	if got := at(back, "spec", "featureGates"); !reflect.DeepEqual(got, want) {
		t.Errorf("gates after a round trip: %v, want %v", got, want)
	}
	if _, err := Convert(v1, "hco.kubevirt.io/v2"); err == nil {
		t.Error("conversion to an unknown version succeeded")
	}
}

func jsonOf(t *testing.T, v any) string {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}
