package hco

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// Every spec field is either acted on, or warned about when set: a new
// field of the type fails here until it is placed in a table.
func TestEveryFieldIsAccountedFor(t *testing.T) {
	if missing := unaccounted("spec", reflect.TypeOf(hcov1beta1.HyperConvergedSpec{})); len(missing) > 0 {
		t.Errorf("HyperConverged fields neither effective nor inert: %v", missing)
	}
	for p := range effective {
		if inert[p] != "" || warnedElsewhere[p] {
			t.Errorf("%s is in two tables", p)
		}
	}
}

func hcFrom(t *testing.T, spec string) *hcov1beta1.HyperConverged {
	t.Helper()
	hc := &hcov1beta1.HyperConverged{}
	hc.Name, hc.Namespace = hcov1beta1.Name, "kubevirt-hyperconverged"
	if err := json.Unmarshal([]byte(`{"spec":`+spec+`}`), hc); err != nil {
		t.Fatal(err)
	}
	return hc
}

func TestInertFieldsAreWarnedAbout(t *testing.T) {
	hc := hcFrom(t, `{
	  "defaultCPUModel": "Haswell",
	  "vmStateStorageClass": "rwx",
	  "featureGates": {"alignCPUs": true, "downwardMetrics": false, "videoConfig": true},
	  "liveMigrationConfig": {"network": "migration-net", "bandwidthPerMigration": "64Mi"},
	  "tlsSecurityProfile": {"type": "Modern", "modern": {}},
	  "higherWorkloadDensity": {"memoryOvercommitPercentage": 150},
	  "kubeMacPoolConfiguration": {"rangeStart": "02:aa:00:00:00:00", "rangeEnd": "02:aa:00:00:ff:ff"},
	  "storagePools": [{"name": "local", "path": "/var/pools/local"}],
	  "evictionStrategy": "LiveMigrate",
	  "logVerbosityConfig": {"kubevirt": {"virtHandler": 4}, "cdi": 3}
	}`)
	warnings, err := Validate(hc, nil)
	if err != nil {
		t.Fatal(err)
	}
	all := strings.Join(warnings, "\n")
	for _, want := range []string{"spec.vmStateStorageClass has no effect in nodevirt: ", "spec.featureGates.alignCPUs has no effect",
		"spec.liveMigrationConfig.network has no effect"} {
		if !strings.Contains(all, want) {
			t.Errorf("no warning %q in:\n%s", want, all)
		}
	}
	// Effective fields and inert ones left at their default draw nothing.
	for _, quiet := range []string{"tlsSecurityProfile", "defaultCPUModel", "downwardMetrics", "videoConfig", "bandwidthPerMigration", "kubeMacPoolConfiguration",
		"storagePools", "evictionStrategy", "higherWorkloadDensity", "logVerbosityConfig", "certConfig", "workloadUpdateStrategy", "uninstallStrategy"} {
		if strings.Contains(all, quiet) {
			t.Errorf("warning about %s:\n%s", quiet, all)
		}
	}

	// An update warns only about what it changes.
	upd := hc.DeepCopyObject().(*hcov1beta1.HyperConverged)
	upd.Spec.VDDKInitImage = ptrTo("registry/vddk:8")
	warnings, err = Validate(upd, hc)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 1 || !strings.HasPrefix(warnings[0], "spec.vddkInitImage has no effect in nodevirt") {
		t.Errorf("update warnings %q, want only spec.vddkInitImage", warnings)
	}
}

// A HyperConverged as the defaults leave it draws no warning.
func TestDefaultHyperConvergedIsQuiet(t *testing.T) {
	warnings, err := Validate(hcFrom(t, `{}`), nil)
	if err != nil || len(warnings) != 0 {
		t.Fatalf("defaults: %q %v", warnings, err)
	}
}
