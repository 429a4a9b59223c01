package ssp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/tools/clientcmd"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templateapi"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
	"github.com/nodevirt/nodevirt/clusterbrain/tekton"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// The controller manager folds the template roles into admin, edit and view.
func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{ControllerManager: true}) }

var served = schema.GroupVersionResource{Group: "template.openshift.io", Version: "v1", Resource: "templates"}

func testLog() *slog.Logger {
	if os.Getenv("SSP_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

type env struct {
	kube kubernetes.Interface
	dyn  dynamic.Interface
	virt *client.Set
	role *Role
	ns   string // the SSP's namespace
}

// start installs the CRDs and runs the role and the template API.
func start(t *testing.T) *env {
	t.Helper()
	cp := controlplane.Shared(t)
	ctx, cancel := context.WithCancel(context.Background())
	testkit.InstallCRDs(t, cp)
	e := &env{kube: cp.Clientset(t), dyn: dynamic.NewForConfigOrDie(cp.RestConfig), ns: cp.Namespace(t)}
	var err error
	if e.virt, err = client.NewSet(cp.RestConfig); err != nil {
		t.Fatal(err)
	}
	if e.role, err = New(Config{Kube: e.kube, Dynamic: e.dyn, Virt: e.virt, Log: testLog()}); err != nil {
		t.Fatal(err)
	}
	api, err := templateapi.New(templateapi.Config{Kube: e.kube, Dynamic: e.dyn, Namespace: e.ns, Addr: ":0", Log: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{}, 2)
	go func() { _ = e.role.Run(ctx); done <- struct{}{} }()
	go func() { _ = api.Run(ctx); done <- struct{}{} }()
	t.Cleanup(func() { cancel(); <-done; <-done })
	select {
	case <-api.Ready():
	case <-time.After(60 * time.Second):
		t.Fatal("template API not ready")
	}
	return e
}

func (e *env) createSSP(t *testing.T, templatesNS string) {
	t.Helper()
	s := &sspv1beta2.SSP{ObjectMeta: metav1.ObjectMeta{Name: "ssp", Namespace: e.ns},
		Spec: sspv1beta2.SSPSpec{CommonTemplates: sspv1beta2.CommonTemplates{Namespace: templatesNS}}}
	if _, err := e.virt.SSPs.Create(context.Background(), s); err != nil {
		t.Fatal(err)
	}
}

func TestCommonTemplatesServedReconciledProcessedAndRemoved(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	tns := e.ns + "-templates" // the HCO's commonTemplatesNamespace, honoured
	t.Cleanup(func() { _ = e.kube.CoreV1().Namespaces().Delete(context.Background(), tns, metav1.DeleteOptions{}) })
	e.createSSP(t, tns)
	want := len(templates.Render(tns))
	api := e.dyn.Resource(served).Namespace(tns)
	testkit.EventuallyEvery(t, 100*time.Millisecond, 90*time.Second, "the common templates served", func() error {
		if err := e.role.Health(); err != nil {
			return err
		}
		list, err := api.List(ctx, metav1.ListOptions{LabelSelector: "os.template.kubevirt.io/fedora43=true"})
		if err != nil {
			return err
		}
		if len(list.Items) != 9 {
			return fmt.Errorf("%d fedora templates through template.openshift.io, want 9", len(list.Items))
		}
		all, err := api.List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(all.Items) != want {
			return fmt.Errorf("%d templates, want %d", len(all.Items), want)
		}
		return nil
	})

	// Metadata-only clients (the garbage collector's, the namespace
	// controller's) list and watch templates too.
	meta := metadata.NewForConfigOrDie(controlplane.Shared(t).RestConfig).Resource(served).Namespace(tns)
	ml, err := meta.List(ctx, metav1.ListOptions{})
	if err != nil || len(ml.Items) != want || ml.Items[0].Kind != "PartialObjectMetadata" || ml.Items[0].Name == "" {
		t.Fatalf("metadata list: %v, %+v", err, ml)
	}
	mw, err := meta.Watch(ctx, metav1.ListOptions{ResourceVersion: ml.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer mw.Stop()

	// An edit through the API is reverted.
	patch := []byte(`{"metadata":{"labels":{"template.kubevirt.io/version":"hacked"}},"parameters":[{"name":"NAME","value":"x"}]}`)
	if _, err := api.Patch(ctx, "rhel9-server-small", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatalf("patch through template.openshift.io: %v", err)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the patched template reverted", func() error {
		got, err := api.Get(ctx, "rhel9-server-small", metav1.GetOptions{})
		if err != nil {
			return err
		}
		params, _ := got.Object["parameters"].([]any)
		if got.GetLabels()[templates.LabelVersion] != templates.Version || len(params) != 4 {
			return fmt.Errorf("not reverted: labels %v, %d parameters", got.GetLabels(), len(params))
		}
		if got.GetAPIVersion() != "template.openshift.io/v1" || got.GetKind() != "Template" {
			return fmt.Errorf("served as %s %s", got.GetAPIVersion(), got.GetKind())
		}
		return nil
	})
	if e.role.Reverts() == 0 {
		t.Error("no revert counted")
	}
	select {
	case ev := <-mw.ResultChan():
		if pm, ok := ev.Object.(*metav1.PartialObjectMetadata); !ok || pm.Name != "rhel9-server-small" {
			t.Errorf("metadata watch event %s %#v", ev.Type, ev.Object)
		}
	case <-time.After(10 * time.Second):
		t.Error("no metadata watch event for the edit")
	}

	// Processing as oc process does: GET the template, POST it with values.
	tmpl, err := api.Get(ctx, "fedora-server-small", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	params := tmpl.Object["parameters"].([]any)
	for _, p := range params {
		if pm := p.(map[string]any); pm["name"] == "DATA_SOURCE_NAME" {
			pm["value"] = "my-fedora"
		}
	}
	body, _ := json.Marshal(tmpl.Object)
	raw, err := e.kube.CoreV1().RESTClient().Post().AbsPath("/apis/template.openshift.io/v1/namespaces/"+tns+"/processedtemplates").
		Body(body).SetHeader("Content-Type", "application/json").DoRaw(ctx)
	if err != nil {
		t.Fatalf("processedtemplates: %v: %s", err, raw)
	}
	var processed map[string]any
	if err := json.Unmarshal(raw, &processed); err != nil {
		t.Fatal(err)
	}
	vm, _ := json.Marshal(processed["objects"].([]any)[0])
	if strings.Contains(string(vm), "${") || !strings.Contains(string(vm), `"name":"my-fedora"`) ||
		!regexp.MustCompile(`"name":"fedora-[a-z0-9]{16}"`).Match(vm) {
		t.Errorf("processed VM: %s", vm)
	}
	bad, _ := json.Marshal(map[string]any{"apiVersion": "template.openshift.io/v1", "kind": "Template",
		"metadata": map[string]any{"name": "x"}, "objects": []any{}, "parameters": []any{map[string]any{"name": "P", "required": true}}})
	if raw, err := e.kube.CoreV1().RESTClient().Post().AbsPath("/apis/template.openshift.io/v1/namespaces/"+tns+"/processedtemplates").
		Body(bad).SetHeader("Content-Type", "application/json").DoRaw(ctx); err == nil || !strings.Contains(string(raw), "required") {
		t.Errorf("a missing required parameter was processed: %v %s", err, raw)
	}

	// virtctl create vm --template prints, then creates, the VM.
	kc := t.TempDir() + "/kubeconfig"
	if err := controlplane.Shared(t).WriteKubeconfig(kc, "ssp-admin", "system:masters"); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	args := []string{"--kubeconfig", kc, "-n", e.ns, "create", "vm", "--template", tns + "/rhel9-server-small", "-p", "DATA_SOURCE_NAME=golden", "--name", "from-template"}
	if code := virtctl.Run(ctx, args, virtctl.IO{Out: &out, Err: &errOut}); code != 0 ||
		!strings.Contains(out.String(), "name: from-template") || !strings.Contains(out.String(), "name: golden") {
		t.Fatalf("virtctl %v: %d\n%s\n%s", args, code, out.String(), errOut.String())
	}
	out.Reset()
	if code := virtctl.Run(ctx, append(args, "--create"), virtctl.IO{Out: &out, Err: &errOut}); code != 0 {
		t.Fatalf("virtctl --create: %s", errOut.String())
	}
	gotVM, err := e.virt.VMs.Get(ctx, e.ns, "from-template")
	if err != nil {
		t.Fatalf("the VM from the template: %v", err)
	}
	if gotVM.Labels[templates.LabelVMTemplate] != "rhel9-server-small" || gotVM.Spec.Template.Spec.Domain.Memory.Guest.String() != "2Gi" {
		t.Errorf("VM from template: labels %v, memory %v", gotVM.Labels, gotVM.Spec.Template.Spec.Domain.Memory.Guest)
	}
	if code := virtctl.Run(ctx, []string{"--kubeconfig", kc, "create", "vm", "--template", tns + "/rhel9-server-small", "-p", "NOPE=1"},
		virtctl.IO{Out: &out, Err: &errOut}); code == 0 {
		t.Error("an unknown parameter was accepted")
	}

	// kubectl finds and prints them as it does OpenShift's.
	if outK, err := exec.Command("kubectl", "--kubeconfig", kc, "get", "templates", "-n", tns, "-l", "os.template.kubevirt.io/fedora43=true", "-o", "name").CombinedOutput(); err != nil ||
		len(strings.Fields(string(outK))) != 9 || !strings.Contains(string(outK), "template.template.openshift.io/fedora-server-small") {
		t.Errorf("kubectl get templates -o name: %v\n%s", err, outK)
	}
	if outK, err := exec.Command("kubectl", "--kubeconfig", kc, "get", "templates", "-n", tns).CombinedOutput(); err != nil ||
		!strings.Contains(string(outK), "windows2k25-server-medium") {
		t.Errorf("kubectl get templates: %v\n%s", err, outK)
	}

	// The pipeline task create-vm-from-template, as a TaskRun passes it
	// its parameters (the array after --).
	resultsDir := t.TempDir()
	admin, err := virtctl.NewClient(controlplane.Shared(t).RestConfig, e.ns)
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	errOut.Reset()
	if code := tekton.Run(ctx, []string{"create-vm-from-template", "--results-dir=" + resultsDir, "--templateName=centos-stream9-server-small",
		"--templateNamespace=" + tns, "--vmNamespace=" + e.ns, "--startVM=false", "--runStrategy=", "--array-param=templateParams", "--",
		"NAME:from-task", "DATA_SOURCE_NAME:golden"}, tekton.Env{Out: &out, Err: &errOut,
		Connect: func(string) (*virtctl.Client, error) { return admin, nil }}); code != 0 {
		t.Fatalf("create-vm-from-template: %s%s", out.String(), errOut.String())
	}
	if data, _ := os.ReadFile(resultsDir + "/name"); string(data) != "from-task" {
		t.Errorf("result name %q", data)
	}
	if task, err := e.virt.VMs.Get(ctx, e.ns, "from-task"); err != nil || task.Spec.RunStrategy == nil || *task.Spec.RunStrategy != "Halted" ||
		task.Spec.DataVolumeTemplates[0].Spec.SourceRef.Name != "golden" {
		t.Errorf("the task's VM: %v %+v", err, task)
	}

	// An ordinary user with edit in her namespace reads the common
	// templates and processes them there, and cannot write the shared ones.
	aliceKC := t.TempDir() + "/alice"
	if err := controlplane.Shared(t).WriteKubeconfig(aliceKC, "alice"); err != nil {
		t.Fatal(err)
	}
	rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "alice-edit", Namespace: e.ns},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "edit"},
		Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: "alice"}}}
	if _, err := e.kube.RbacV1().RoleBindings(e.ns).Create(ctx, rb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "alice creating a vm from a template", func() error { // the aggregation controller folds the template roles into edit
		out.Reset()
		errOut.Reset()
		if code := virtctl.Run(ctx, []string{"--kubeconfig", aliceKC, "-n", e.ns, "create", "vm", "--template", tns + "/fedora-server-small"},
			virtctl.IO{Out: &out, Err: &errOut}); code != 0 {
			return fmt.Errorf("alice: %s", errOut.String())
		}
		return nil
	})
	aliceCfg, err := clientcmd.BuildConfigFromFlags("", aliceKC)
	if err != nil {
		t.Fatal(err)
	}
	aliceTemplates := dynamic.NewForConfigOrDie(aliceCfg).Resource(served).Namespace(tns)
	if _, err := aliceTemplates.Patch(ctx, "fedora-server-small", types.MergePatchType, []byte(`{"message":"x"}`), metav1.PatchOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("alice edited a common template: %v", err)
	}

	// A user's own template in the same namespace is left alone.
	own := map[string]any{"apiVersion": "template.openshift.io/v1", "kind": "Template", "metadata": map[string]any{"name": "mine"}, "objects": []any{}}
	ownData, _ := json.Marshal(own)
	if raw, err := e.kube.CoreV1().RESTClient().Post().AbsPath("/apis/template.openshift.io/v1/namespaces/"+tns+"/templates").
		Body(ownData).SetHeader("Content-Type", "application/json").DoRaw(ctx); err != nil {
		t.Fatalf("create a user template: %v %s", err, raw)
	}

	// Boot sources: the SSP's dataImportCronTemplates become
	// DataImportCrons; edits are reverted; dropping one removes it.
	url := "docker://registry.invalid/os:latest"
	withCron, err := e.virt.SSPs.Get(ctx, e.ns, "ssp")
	if err != nil {
		t.Fatal(err)
	}
	withCron.Spec.CommonTemplates.DataImportCronTemplates = []hcov1beta1.DataImportCronTemplate{{
		ObjectMeta: metav1.ObjectMeta{Name: "os-image-cron", Namespace: tns},
		Spec: &cdiv1.DataImportCronSpec{Schedule: "0 */12 * * *", ManagedDataSource: "os",
			Template: cdiv1.DataVolume{Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Registry: &cdiv1.DataVolumeSourceRegistry{URL: &url}}}}}}}
	if _, err := e.virt.SSPs.Update(ctx, withCron); err != nil {
		t.Fatal(err)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the DataImportCron of the boot source", func() error {
		dic, err := e.virt.DataImportCrons.Get(ctx, tns, "os-image-cron")
		if err != nil {
			return err
		}
		if dic.Spec.Schedule != "0 */12 * * *" {
			return fmt.Errorf("schedule %q", dic.Spec.Schedule)
		}
		if dic.Spec.ManagedDataSource == "os" {
			return nil
		}
		return fmt.Errorf("dataimportcron %+v", dic.Spec)
	})
	if _, err := e.virt.DataImportCrons.Patch(ctx, tns, "os-image-cron", types.MergePatchType, []byte(`{"spec":{"schedule":"* * * * *"}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the edited DataImportCron reverted", func() error {
		dic, err := e.virt.DataImportCrons.Get(ctx, tns, "os-image-cron")
		if err != nil || dic.Spec.Schedule != "0 */12 * * *" {
			return fmt.Errorf("edit not reverted: %v %v", dic, err)
		}
		return nil
	})
	withCron, err = e.virt.SSPs.Get(ctx, e.ns, "ssp")
	if err != nil {
		t.Fatal(err)
	}
	withCron.Spec.CommonTemplates.DataImportCronTemplates = nil
	if _, err := e.virt.SSPs.Update(ctx, withCron); err != nil {
		t.Fatal(err)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the dropped boot source's DataImportCron to go", func() error {
		if _, err := e.virt.DataImportCrons.Get(ctx, tns, "os-image-cron"); !apierrors.IsNotFound(err) {
			return fmt.Errorf("dropped boot source still there: %v", err)
		}
		return nil
	})

	// Removed with the SSP.
	if err := e.virt.SSPs.Delete(ctx, e.ns, "ssp", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 60*time.Second, "the templates to go with the SSP", func() error {
		all, err := api.List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(all.Items) != 1 || all.Items[0].GetName() != "mine" {
			return fmt.Errorf("%d templates left", len(all.Items))
		}
		return nil
	})

	// The namespace controller empties and removes a templates namespace.
	if err := e.kube.CoreV1().Namespaces().Delete(ctx, tns, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 90*time.Second, "namespace "+tns+" deleted", func() error {
		if _, err := e.kube.CoreV1().Namespaces().Get(ctx, tns, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("namespace %s not deleted: %v", tns, err)
		}
		return nil
	})
}
