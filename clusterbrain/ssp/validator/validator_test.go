package validator

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// vmFrom processes a common template and returns its VM as decoded JSON.
func vmFrom(t *testing.T, name string, edit func(vm map[string]any)) map[string]any {
	t.Helper()
	for _, tm := range templates.Render("openshift") {
		if tm["metadata"].(map[string]any)["name"] != name {
			continue
		}
		out, err := templates.Process(tm, map[string]string{"NAME": "vm-" + strings.ReplaceAll(name, ".", "-")})
		if err != nil {
			t.Fatal(err)
		}
		vm := out["objects"].([]any)[0].(map[string]any)
		data, _ := json.Marshal(vm) // ints as JSON numbers, as the API sends them
		var decoded map[string]any
		_ = json.Unmarshal(data, &decoded)
		if edit != nil {
			edit(decoded)
		}
		return decoded
	}
	t.Fatalf("no template %s", name)
	return nil
}

func domain(vm map[string]any) map[string]any {
	return vm["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["domain"].(map[string]any)
}

func rulesOf(vm map[string]any) []Rule {
	r, err := ParseRules(vm["metadata"].(map[string]any)["annotations"].(map[string]any)[templates.AnnValidations].(string))
	if err != nil {
		panic(err)
	}
	return r
}

func TestCommonTemplateRules(t *testing.T) {
	ok := vmFrom(t, "windows11-desktop-medium", nil)
	if out := Evaluate(rulesOf(ok), ok); len(out.Causes) != 0 {
		t.Errorf("a VM as its template makes it is refused: %+v", out.Causes)
	} else if len(out.Warnings) != 1 || !strings.HasPrefix(out.Warnings[0], "virtio disk bus type has better performance") {
		t.Errorf("warnings of a sata Windows 11 disk: %q", out.Warnings)
	}

	bad := vmFrom(t, "windows11-desktop-medium", func(vm map[string]any) {
		d := domain(vm)
		d["memory"] = map[string]any{"guest": "1Gi"}
		d["cpu"].(map[string]any)["cores"] = 1
		dev := d["devices"].(map[string]any)
		dev["disks"] = append(dev["disks"].([]any), map[string]any{"name": "cd", "cdrom": map[string]any{"bus": "virtio"}},
			map[string]any{"name": "d2", "disk": map[string]any{"bus": "usb"}})
	})
	out := Evaluate(rulesOf(bad), bad)
	want := map[string]string{
		".spec.domain.memory.guest":               "This VM requires more memory.: value 1073741824 is lower than minimum [4294967296]",
		".spec.domain.cpu.cores":                  "This VM requires more cores.: value 1 is lower than minimum [2]",
		".spec.domain.devices.disks[*].disk.bus":  "disk bus has to be either virtio or sata or scsi: Some of [sata, usb] are not in [virtio, sata, scsi]",
		".spec.domain.devices.disks[*].cdrom.bus": "cd bus has to be sata: Some of [virtio] are not in [sata]",
	}
	got := map[string]string{}
	for _, c := range out.Causes {
		got[c.Field] = c.Message
	}
	for f, m := range want {
		if got[f] != m {
			t.Errorf("cause for %s: %q, want %q", f, got[f], m)
		}
	}
	if len(out.Causes) != len(want) {
		t.Errorf("causes %+v", out.Causes)
	}

	// A rule whose valid path is absent does not apply; missing CPU
	// topology counts as one.
	linux := vmFrom(t, "fedora-server-small", func(vm map[string]any) { delete(domain(vm), "cpu") })
	rules := append(rulesOf(linux), Rule{Name: "cd", Path: "jsonpath::.spec.domain.devices.disks[*].cdrom.bus",
		Valid: "jsonpath::.spec.domain.devices.disks[*].cdrom.bus", Rule: Enum, Values: []string{"sata"}, Message: "cd bus has to be sata"},
		Rule{Name: "cores", Path: "jsonpath::.spec.domain.cpu.cores", Rule: Integer, Min: json.RawMessage(`2`), Message: "more cores"},
		Rule{Name: "name", Path: "jsonpath::.metadata.labels.kubevirt\\.io/domain", Rule: Regex, Regex: "^vm-", Message: "named vm-"},
		Rule{Name: "len", Path: "jsonpath::.metadata.labels.kubevirt\\.io/size", Rule: String, MaxLength: json.RawMessage(`3`), Message: "short size", JustWarning: true},
		Rule{Name: "len", Path: "jsonpath::.spec.domain.cpu.cores", Rule: Integer, Message: "dup"})
	out = Evaluate(rules, linux)
	if len(out.Causes) != 2 || out.Causes[0].Message != "more cores: value 1 is lower than minimum [2]" || out.Causes[1].Message != "dup: duplicate Rule Name" {
		t.Errorf("causes %+v", out.Causes)
	}
	if len(out.Warnings) != 1 || !strings.HasPrefix(out.Warnings[0], "short size: length of \"small\"") {
		t.Errorf("warnings %q", out.Warnings)
	}
}

// TestWebhookRefusesAndWarns runs the validator on the brain's webhook
// server against the real API server: a VM from a template that breaks a
// rule is refused naming the rule; one that only breaks a justWarning rule
// is created with the warning; a VM naming a stored template is checked
// against that template's rules.
func TestWebhookRefusesAndWarns(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	testkit.InstallCRDs(t, cp)
	kube := cp.Clientset(t)
	ns := cp.Namespace(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	s, err := admission.New(admission.Config{Addr: "127.0.0.1:0", Namespace: ns}, admission.Deps{Kube: kube, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	if err := Register(cp.RestConfig)(s); err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Run(runCtx) }()
	t.Cleanup(func() { _ = admission.Uninstall(context.Background(), kube, ns); cancel(); <-done })
	<-s.Ready()

	warnings := &collect{}
	rc := rest.CopyConfig(cp.RestConfig)
	rc.WarningHandler = warnings
	virt, err := client.NewSet(rc)
	if err != nil {
		t.Fatal(err)
	}
	create := func(obj map[string]any) error {
		data, _ := json.Marshal(obj)
		vm := &kubevirtv1.VirtualMachine{}
		if err := json.Unmarshal(data, vm); err != nil {
			t.Fatal(err)
		}
		vm.Namespace = ns
		_, err := virt.VMs.Create(ctx, vm)
		return err
	}
	small := vmFrom(t, "rhel9-server-small", func(vm map[string]any) { domain(vm)["memory"] = map[string]any{"guest": "512Mi"} })
	var err2 error
	_ = testkit.Wait(200*time.Millisecond, 30*time.Second, "the validator's refusal", func() (bool, error) {
		err2 = create(small)
		if err2 == nil { // created before the webhook was published
			_ = virt.VMs.Delete(ctx, ns, small["metadata"].(map[string]any)["name"].(string), metav1.DeleteOptions{})
		}
		return err2 != nil && strings.Contains(err2.Error(), "requires more memory"), nil
	})
	if !apierrors.IsInvalid(err2) || !strings.Contains(err2.Error(), "This VM requires more memory.: value 536870912 is lower than minimum [1610612736]") {
		t.Fatalf("a rhel9 VM with 512Mi: %v", err2)
	}

	win := vmFrom(t, "windows10-desktop-medium", nil)
	if err := create(win); err != nil {
		t.Fatalf("a Windows 10 VM as its template makes it: %v", err)
	}
	if !strings.Contains(strings.Join(warnings.msgs, "\n"), "virtio disk bus type has better performance") {
		t.Errorf("warnings %q", warnings.msgs)
	}

	// Rules from the template the labels name, on update too.
	tmpl := map[string]any{"apiVersion": templates.StorageGroup + "/" + templates.StorageVersion, "kind": templates.StorageKind,
		"metadata": map[string]any{"name": "strict", "namespace": ns, "annotations": map[string]any{AnnTemplateValidations: `[{"name":"max-mem","path":"jsonpath::.spec.domain.memory.guest","rule":"integer","message":"too much memory","max":"1Gi"}]`}},
		"objects":  []any{}}
	data, _ := json.Marshal(tmpl)
	if _, err := kube.CoreV1().RESTClient().Post().AbsPath("/apis/"+templates.StorageGroup+"/"+templates.StorageVersion+"/namespaces/"+ns+"/"+templates.StorageResource).
		Body(data).SetHeader("Content-Type", "application/json").DoRaw(ctx); err != nil {
		t.Fatal(err)
	}
	vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: "labelled", Namespace: ns,
		Labels: map[string]string{templates.LabelVMTemplate: "strict", templates.LabelVMTemplateNamespace: ns}},
		Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{}}}
	if _, err := virt.VMs.Create(ctx, vm); err != nil {
		t.Fatalf("a VM within its template's rules: %v", err)
	}
	got, err := virt.VMs.Get(ctx, ns, "labelled")
	if err != nil {
		t.Fatal(err)
	}
	g := kubevirtv1.Memory{}
	q := mustQuantity("2Gi")
	g.Guest = &q
	got.Spec.Template.Spec.Domain.Memory = &g
	if _, err := virt.VMs.Update(ctx, got); err == nil || !strings.Contains(err.Error(), "too much memory: value 2147483648 is higher than maximum [1073741824]") ||
		!strings.Contains(err.Error(), "template "+ns+"/strict") {
		t.Errorf("an update breaking the template's rule: %v", err)
	}
}
