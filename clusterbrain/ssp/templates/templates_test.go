package templates

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestCatalogueCoversUpstreamSet(t *testing.T) {
	all := Render("openshift")
	byOS := map[string]int{}
	names := map[string]bool{}
	defaults := map[string]int{}
	for _, tm := range all {
		md := tm["metadata"].(map[string]any)
		name := md["name"].(string)
		if names[name] {
			t.Errorf("template %s twice", name)
		}
		names[name] = true
		vm := tm["objects"].([]any)[0].(map[string]any)
		os := vm["spec"].(map[string]any)["template"].(map[string]any)["metadata"].(map[string]any)["annotations"].(map[string]any)["vm.kubevirt.io/os"].(string)
		byOS[os]++
		if md["labels"].(map[string]any)[LabelDefaultVariant] == "true" {
			defaults[os]++
		}
	}
	// The v0.35 amd64 bundle's counts, plus CentOS Stream 10 and RHEL 10.
	want := map[string]int{"centos-stream9": 8, "centos-stream10": 8, "centos6": 4, "fedora": 9, "opensuse": 3, "rhel7": 12,
		"rhel8": 12, "rhel9": 12, "rhel10": 12, "ubuntu": 6, "windows10": 4, "windows11": 4, "windows2k16": 4, "windows2k19": 4,
		"windows2k22": 4, "windows2k25": 4}
	for os, n := range want {
		if byOS[os] != n {
			t.Errorf("%s: %d templates, want %d", os, byOS[os], n)
		}
		if defaults[os] != 1 {
			t.Errorf("%s: %d default variants, want 1", os, defaults[os])
		}
	}
	if len(byOS) != len(want) {
		t.Errorf("families %v", byOS)
	}
	for _, n := range []string{"fedora-server-small", "rhel9-highperformance-tiny", "windows11-desktop-medium", "windows2k25-server-large", "centos-stream9-desktop-tiny"} {
		if !names[n] {
			t.Errorf("missing %s", n)
		}
	}
}

// TestEveryTemplateProcessesToAValidVM processes every template and decodes
// its VM strictly into KubeVirt's own type: no field is misspelt.
func TestEveryTemplateProcessesToAValidVM(t *testing.T) {
	for _, tm := range Render("openshift") {
		name := tm["metadata"].(map[string]any)["name"].(string)
		out, err := Process(tm, map[string]string{"NAME": "my-vm"})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		data, err := json.Marshal(out["objects"].([]any)[0])
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(data), "${") {
			t.Errorf("%s: unsubstituted parameter in %s", name, data)
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		var vm kubevirtv1.VirtualMachine
		if err := dec.Decode(&vm); err != nil {
			t.Errorf("%s: not a VirtualMachine: %v", name, err)
			continue
		}
		if vm.Name != "my-vm" || vm.Labels[LabelVMTemplate] != name || vm.Spec.DataVolumeTemplates[0].Spec.SourceRef.Namespace == nil ||
			*vm.Spec.DataVolumeTemplates[0].Spec.SourceRef.Namespace != DefaultDataSourceNamespace {
			t.Errorf("%s: %+v", name, vm.ObjectMeta)
		}
		var rs []Rule
		if err := json.Unmarshal([]byte(vm.Annotations[AnnValidations]), &rs); err != nil || len(rs) == 0 {
			t.Errorf("%s: validations %q: %v", name, vm.Annotations[AnnValidations], err)
		}
	}
}

func TestProcessGeneratesAndRefuses(t *testing.T) {
	var fedora map[string]any
	for _, tm := range Render("openshift") {
		if tm["metadata"].(map[string]any)["name"] == "fedora-server-small" {
			fedora = tm
		}
	}
	out, err := Process(fedora, map[string]string{"DATA_SOURCE_NAME": "my-fedora"})
	if err != nil {
		t.Fatal(err)
	}
	vm := out["objects"].([]any)[0].(map[string]any)
	name := vm["metadata"].(map[string]any)["name"].(string)
	if !regexp.MustCompile(`^fedora-[a-z0-9]{16}$`).MatchString(name) {
		t.Errorf("generated NAME %q", name)
	}
	data, _ := json.Marshal(vm)
	if !strings.Contains(string(data), `"name":"my-fedora"`) ||
		!regexp.MustCompile(`password: [a-z0-9]{4}-[a-z0-9]{4}-[a-z0-9]{4}\\n`).Match(data) {
		t.Errorf("parameters not substituted: %s", data)
	}
	params := out["parameters"].([]any)
	if params[0].(map[string]any)["value"] != name {
		t.Errorf("generated value not returned: %v", params[0])
	}
	if _, err := Process(fedora, map[string]string{"NOPE": "x"}); err == nil || !strings.Contains(err.Error(), `unknown parameter name "NOPE"`) {
		t.Errorf("unknown parameter: %v", err)
	}
	req := map[string]any{"objects": []any{map[string]any{"replicas": "${{N}}", "name": "x-${N}"}},
		"parameters": []any{map[string]any{"name": "N", "required": true}}}
	if _, err := Process(req, nil); err == nil || !strings.Contains(err.Error(), "required") {
		t.Errorf("required parameter: %v", err)
	}
	got, err := Process(req, map[string]string{"N": "3"})
	if err != nil {
		t.Fatal(err)
	}
	if o := got["objects"].([]any)[0].(map[string]any); o["replicas"] != float64(3) || o["name"] != "x-3" {
		t.Errorf("${{N}} and ${N}: %v", o)
	}
}

func TestGenerate(t *testing.T) {
	for expr, re := range map[string]string{
		"[a-z0-9]{16}":       `^[a-z0-9]{16}$`,
		"win-[A-Z]{3}x":      `^win-[A-Z]{3}x$`,
		`\d{4}-[\w]{2}`:      `^[0-9]{4}-[a-zA-Z0-9_]{2}$`,
		"[a-c-]{5}":          `^[a-c-]{5}$`,
		"fedora-[a-z0-9]{6}": `^fedora-[a-z0-9]{6}$`,
	} {
		got, err := Generate(expr)
		if err != nil || !regexp.MustCompile(re).MatchString(got) {
			t.Errorf("Generate(%q) = %q, %v", expr, got, err)
		}
	}
	for _, bad := range []string{"[a-z", "x{3", "[z-a]", "a{999}"} {
		if _, err := Generate(bad); err == nil {
			t.Errorf("Generate(%q) succeeded", bad)
		}
	}
}

// TestGenerateIsBounded: an expression that would generate more than
// MaxGenerated bytes is refused, not built.
func TestGenerateIsBounded(t *testing.T) {
	if _, err := Generate(strings.Repeat("[a-z]{255}", MaxGenerated/255+1)); err == nil {
		t.Fatal("an expression generating more than MaxGenerated bytes was accepted")
	}
	if got, err := Generate(strings.Repeat("[a-z]{255}", 4)); err != nil || len(got) != 4*255 {
		t.Fatalf("Generate: %d bytes, %v", len(got), err)
	}
}
