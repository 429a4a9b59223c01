package tekton

import (
	"bytes"
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

type env struct {
	c       *virtctl.Client
	ns      string
	results string
}

func start(t *testing.T) *env {
	t.Helper()
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	ns := cp.Namespace(t)
	c, err := virtctl.NewClient(cp.RestConfig, ns)
	if err != nil {
		t.Fatal(err)
	}
	return &env{c: c, ns: ns, results: t.TempDir()}
}

// run runs a task and returns its output and error output.
func (e *env) run(t *testing.T, wantCode int, args ...string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	args = append([]string{args[0], "--results-dir=" + e.results}, args[1:]...)
	code := Run(context.Background(), args, Env{Out: &out, Err: &errOut,
		Connect: func(string) (*virtctl.Client, error) { return e.c, nil }})
	if code != wantCode {
		t.Fatalf("%v: exit %d, want %d\n%s%s", args, code, wantCode, out.String(), errOut.String())
	}
	return out.String() + errOut.String()
}

func (e *env) result(t *testing.T, name string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(e.results, name))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func TestCreateFromManifestAndCleanup(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	manifest := `apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: from-manifest
spec:
  template:
    spec:
      domain:
        devices: {}
        memory:
          guest: 64Mi
`
	e.run(t, 0, "create-vm-from-manifest", "--manifest="+manifest, "--startVM=true")
	if e.result(t, "name") != "from-manifest" || e.result(t, "namespace") != e.ns {
		t.Errorf("results %q %q", e.result(t, "name"), e.result(t, "namespace"))
	}
	vm, err := e.c.Virt.VMs.Get(ctx, e.ns, "from-manifest")
	if err != nil {
		t.Fatal(err)
	}
	if vm.Spec.RunStrategy == nil || *vm.Spec.RunStrategy != kubevirtv1.RunStrategyAlways {
		t.Errorf("startVM=true: runStrategy %v", vm.Spec.RunStrategy)
	}
	if out := e.run(t, 1, "create-vm-from-manifest", "--manifest=kind: Pod\nmetadata: {name: x}\n"); !strings.Contains(out, "not a VirtualMachine") {
		t.Errorf("a Pod manifest: %s", out)
	}

	e.run(t, 0, "cleanup-vm", "--vmName=from-manifest", "--stop=true", "--delete=true", "--timeout=30s")
	if _, err := e.c.Virt.VMs.Get(ctx, e.ns, "from-manifest"); err == nil {
		t.Error("the VM is still there after cleanup-vm --delete")
	}
}

func TestWaitForVMIStatus(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "w", Namespace: e.ns}}
	got, err := e.c.Virt.VMIs.Create(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(time.Second)
		got.Status.Phase = kubevirtv1.Running
		_, _ = e.c.Virt.VMIs.UpdateStatus(ctx, got)
	}()
	t0 := time.Now()
	e.run(t, 0, "wait-for-vmi-status", "--vmiName=w", "--successCondition=status.phase == Running",
		"--failureCondition=status.phase in (Failed, Unknown)", "--poll=100ms")
	if time.Since(t0) < 900*time.Millisecond {
		t.Error("succeeded before the VMI ran")
	}
	if out := e.run(t, 1, "wait-for-vmi-status", "--vmiName=w", "--successCondition=status.phase == Succeeded",
		"--failureCondition=status.phase in (Running)"); !strings.Contains(out, "failure condition") {
		t.Errorf("failure condition: %s", out)
	}
	if out := e.run(t, 1, "wait-for-vmi-status", "--vmiName=w", "--successCondition=status.phase ==="); !strings.Contains(out, "successCondition") {
		t.Errorf("a bad condition: %s", out)
	}
}

func TestGenerateSSHKeys(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	e.run(t, 0, "generate-ssh-keys", "--privateKeySecretName=priv", "--array-param=privateKeyConnectionOptions", "--",
		"user:fedora", "disable-strict-host-key-checking:true")
	pub, err := e.c.Kube.CoreV1().Secrets(e.ns).Get(ctx, e.result(t, "publicKeySecretName"), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	priv, err := e.c.Kube.CoreV1().Secrets(e.ns).Get(ctx, "priv", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if string(priv.Data["user"]) != "fedora" || e.result(t, "privateKeySecretNamespace") != e.ns {
		t.Errorf("private secret %v", priv.Data)
	}
	keyFile := filepath.Join(t.TempDir(), "id")
	if err := os.WriteFile(keyFile, priv.Data[PrivateKeyKey], 0o600); err != nil {
		t.Fatal(err)
	}
	derived, err := exec.Command("ssh-keygen", "-y", "-f", keyFile).Output()
	if err != nil {
		t.Fatalf("ssh-keygen reads the private key: %v", err)
	}
	if strings.Fields(string(derived))[1] != strings.Fields(string(pub.Data[PublicKeyKey]))[1] {
		t.Errorf("public key %q does not match the private key's %q", pub.Data[PublicKeyKey], derived)
	}
}

func TestTaskManifests(t *testing.T) {
	files, err := Tasks()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		"create-vm-from-manifest.yaml": {"manifest", "namespace", "startVM", "runStrategy"},
		"create-vm-from-template.yaml": {"templateName", "templateNamespace", "templateParams", "vmNamespace", "startVM", "runStrategy"},
		"wait-for-vmi-status.yaml":     {"vmiName", "vmiNamespace", "successCondition", "failureCondition"},
		"cleanup-vm.yaml":              {"vmName", "vmNamespace", "stop", "delete", "timeout"},
		"generate-ssh-keys.yaml":       {"publicKeySecretName", "publicKeySecretNamespace", "privateKeySecretName", "privateKeySecretNamespace", "privateKeyConnectionOptions"},
		"copy-template.yaml":           {"sourceTemplateName", "sourceTemplateNamespace", "targetTemplateName", "targetTemplateNamespace", "allowReplace", "setOwnerReference"},
		"modify-vm-template.yaml": {"templateName", "templateNamespace", "cpuSockets", "cpuCores", "cpuThreads", "memory", "templateLabels",
			"templateAnnotations", "vmLabels", "vmAnnotations", "disks", "deleteDisks", "volumes", "datavolumeTemplates",
			"deleteDatavolumeTemplate", "deleteVolumes", "templateParameters", "deleteTemplateParameters", "deleteTemplate"},
		"modify-data-object.yaml": {"manifest", "namespace", "waitForSuccess", "allowReplace", "deleteObject", "deleteObjectKind",
			"deleteObjectName", "timeout", "setOwnerReference"},
		"execute-in-vm.yaml":       {"vmName", "vmNamespace", "secretName", "command", "args", "script"},
		"disk-virt-customize.yaml": {"pvc", "virtCommands", "verbose", "additionalVirtOptions"},
		"disk-virt-sysprep.yaml":   {"pvc", "virtCommands", "verbose", "additionalVirtOptions"},
	}
	if len(files) != len(want) {
		t.Errorf("%d task manifests, %d checked", len(files), len(want))
	}
	for name, params := range want {
		var task struct {
			APIVersion, Kind string
			Metadata         struct{ Name string }
			Spec             struct {
				Params []struct{ Name string }
				Steps  []struct{ Args []string }
			}
		}
		if err := yaml.Unmarshal(files[name], &task); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if task.APIVersion != "tekton.dev/v1" || task.Kind != "Task" || task.Metadata.Name+".yaml" != name {
			t.Errorf("%s: %s %s %s", name, task.APIVersion, task.Kind, task.Metadata.Name)
		}
		have := map[string]bool{}
		for _, p := range task.Spec.Params {
			have[p.Name] = true
		}
		for _, p := range params {
			if !have[p] {
				t.Errorf("%s: no parameter %s", name, p)
			}
		}
		// The step's arguments parse as the program's flags.
		args := task.Spec.Steps[0].Args
		if len(args) == 0 || args[0]+".yaml" != name {
			t.Errorf("%s: step args %v", name, args)
			continue
		}
		tk := tasks[args[0]]
		if tk.run == nil {
			t.Errorf("%s: no such task in the program", name)
			continue
		}
		// Every $(params.X) flag the step passes is one of the program's
		// flags, and every parameter reaches the step.
		fs := flag.NewFlagSet(name, flag.ContinueOnError)
		fs.String("results-dir", "", "")
		fs.String("array-param", "", "")
		tk.run(context.Background(), fs)
		joined := strings.Join(args, "\n")
		for _, a := range args[1:] {
			if a == "--" {
				break
			}
			flagName, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
			if fs.Lookup(flagName) == nil {
				t.Errorf("%s: the step passes --%s, which the program does not know", name, flagName)
			}
		}
		for p := range have {
			if p != "image" && !strings.Contains(joined, "$(params."+p+")") && !strings.Contains(joined, "$(params."+p+"[*])") {
				t.Errorf("%s: parameter %s does not reach the step", name, p)
			}
		}
		for _, a := range args {
			if n, ok := strings.CutPrefix(a, "--array-param="); ok && fs.Lookup(n) == nil {
				t.Errorf("%s: array parameter %s is no flag", name, n)
			}
		}
	}
}
