package tekton

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templateapi"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func testLog() *slog.Logger {
	if os.Getenv("TEKTON_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// withTemplates runs the brain's template.openshift.io API and puts the
// common template name (as the SSP renders it) into the test's namespace.
func (e *env) withTemplates(t *testing.T, name string) dynamic.ResourceInterface {
	t.Helper()
	cp := controlplane.Shared(t)
	dyn := dynamic.NewForConfigOrDie(cp.RestConfig)
	api, err := templateapi.New(templateapi.Config{Kube: e.c.Kube, Dynamic: dyn, Namespace: e.ns, Addr: ":0",
		Log: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = api.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-api.Ready():
	case <-time.After(90 * time.Second):
		t.Fatal("template API not ready")
	}
	res := dyn.Resource(templateResource).Namespace(e.ns)
	for _, tmpl := range templates.Render(e.ns) {
		md := tmpl["metadata"].(map[string]any)
		if md["name"] != name {
			continue
		}
		testkit.Eventually(t, 60*time.Second, "the aggregator serves the template API", func() error {
			_, err := res.Create(context.Background(), &unstructured.Unstructured{Object: tmpl}, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				return nil
			}
			return err
		})
		return res
	}
	t.Fatalf("no common template %s", name)
	return nil
}

func vmOf(t *testing.T, tmpl *unstructured.Unstructured) *kubevirtv1.VirtualMachine {
	t.Helper()
	_, raw, err := vmObject(tmpl)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := json.Marshal(raw)
	vm := &kubevirtv1.VirtualMachine{}
	if err := json.Unmarshal(data, vm); err != nil {
		t.Fatal(err)
	}
	return vm
}

func TestCopyTemplate(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	res := e.withTemplates(t, "fedora-server-small")

	e.run(t, 0, "copy-template", "--sourceTemplateName=fedora-server-small", "--targetTemplateName=my-fedora")
	if e.result(t, "name") != "my-fedora" || e.result(t, "namespace") != e.ns {
		t.Errorf("results %q %q", e.result(t, "name"), e.result(t, "namespace"))
	}
	cp, err := res.Get(ctx, "my-fedora", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l := cp.GetLabels()
	if l[templates.LabelType] != "vm" || l[templates.LabelManagedBy] != "" || l[templates.LabelVersion] != "" {
		t.Errorf("copy's labels %v", l)
	}
	for k := range l {
		if strings.HasPrefix(k, templates.LabelOSPrefix) || strings.HasPrefix(k, templates.LabelFlavorPrefix) {
			t.Errorf("copy keeps the common label %s", k)
		}
	}
	vm := vmOf(t, cp)
	if vm.Labels[templates.LabelVMTemplate] != "my-fedora" || vm.Labels[templates.LabelVMTemplateVersion] != "" {
		t.Errorf("copy's VM labels %v", vm.Labels)
	}
	// The copy is still processed as a template (parameters kept).
	objs, err := e.c.ProcessTemplate(ctx, "my-fedora", map[string]string{"NAME": "from-copy", "DATA_SOURCE_NAME": "golden"})
	if err != nil || len(objs) != 1 {
		t.Fatalf("process the copy: %v %v", err, objs)
	}

	// A second copy under the same name is refused, unless allowReplace.
	if out := e.run(t, 1, "copy-template", "--sourceTemplateName=fedora-server-small", "--targetTemplateName=my-fedora"); !strings.Contains(out, "already exists") {
		t.Errorf("copy onto an existing template: %s", out)
	}
	if _, err := res.Patch(ctx, "my-fedora", types.MergePatchType, []byte(`{"metadata":{"labels":{"edited":"yes"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	e.run(t, 0, "copy-template", "--sourceTemplateName=fedora-server-small", "--targetTemplateName=my-fedora", "--allowReplace=true")
	if again, err := res.Get(ctx, "my-fedora", metav1.GetOptions{}); err != nil || again.GetLabels()["edited"] != "" {
		t.Errorf("allowReplace did not replace the edited copy: %v %v", err, again.GetLabels())
	}

	// Without a target name the copy's name is generated; a user's
	// template (not base) keeps its labels.
	e.run(t, 0, "copy-template", "--sourceTemplateName=my-fedora")
	gen := e.result(t, "name")
	if !strings.HasPrefix(gen, "my-fedora") || gen == "my-fedora" {
		t.Errorf("generated name %q", gen)
	}

	// setOwnerReference: the TaskRun's pod (created here without a
	// kubelet: only its identity matters) owns the copy.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}
	if _, err := e.c.Kube.CoreV1().ServiceAccounts(e.ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	pod, err := e.c.Kube.CoreV1().Pods(e.ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "taskrun-pod"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "step", Image: "nodevirt-tasks"}}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(PodNameEnv, pod.Name)
	t.Setenv(PodNamespaceEnv, e.ns)
	e.run(t, 0, "copy-template", "--sourceTemplateName=fedora-server-small", "--targetTemplateName=owned", "--setOwnerReference=true")
	owned, err := res.Get(ctx, "owned", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if refs := owned.GetOwnerReferences(); len(refs) != 1 || refs[0].UID != pod.UID || refs[0].Kind != "Pod" {
		t.Errorf("owner references %v", refs)
	}

	if out := e.run(t, 1, "copy-template", "--sourceTemplateName=no-such"); !strings.Contains(out, "not found") {
		t.Errorf("a missing source: %s", out)
	}
	if out := e.run(t, 1, "copy-template", "--targetTemplateName=x"); !strings.Contains(out, "sourceTemplateName is required") {
		t.Errorf("no source: %s", out)
	}
}

func TestModifyVMTemplate(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	res := e.withTemplates(t, "centos-stream9-server-small")
	name := "centos-stream9-server-small"

	e.run(t, 0, "modify-vm-template", "--templateName="+name, "--cpuSockets=2", "--cpuCores=3", "--cpuThreads=0", "--memory=3Gi",
		"--deleteTemplateParameters=false", "--",
		"--array-param=templateLabels", "team: virt", "--array-param=templateAnnotations", "note:http://a:b",
		"--array-param=vmLabels", "app:db", "--array-param=vmAnnotations",
		"--array-param=disks", `{"name":"extra","disk":{"bus":"virtio"}}`, `{"name":"rootdisk","disk":{"bus":"sata"}}`,
		"--array-param=volumes", `{"name":"extra","containerDisk":{"image":"quay.io/x/y"}}`,
		"--array-param=templateParameters", `{"name":"EXTRA","value":"1"}`, `{"name":"NAME","description":"the VM's name","generate":"expression","from":"vm-[a-z0-9]{8}"}`)
	if e.result(t, "name") != name {
		t.Errorf("result name %q", e.result(t, "name"))
	}
	got, err := res.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetLabels()["team"] != "virt" || got.GetAnnotations()["note"] != "http://a:b" {
		t.Errorf("template labels %v annotations %v", got.GetLabels(), got.GetAnnotations())
	}
	vm := vmOf(t, got)
	cpu := vm.Spec.Template.Spec.Domain.CPU
	if cpu == nil || cpu.Sockets != 2 || cpu.Cores != 3 || cpu.Threads != 1 {
		t.Errorf("cpu %+v (threads 0 leaves the template's 1)", cpu)
	}
	if m := vm.Spec.Template.Spec.Domain.Memory; m == nil || m.Guest == nil || m.Guest.String() != "3Gi" {
		t.Errorf("memory %+v", m)
	}
	if vm.Labels["app"] != "db" {
		t.Errorf("vm labels %v", vm.Labels)
	}
	disks := vm.Spec.Template.Spec.Domain.Devices.Disks
	byName := map[string]kubevirtv1.Disk{}
	for _, d := range disks {
		byName[d.Name] = d
	}
	if d, ok := byName["rootdisk"]; !ok || d.Disk == nil || d.Disk.Bus != "sata" {
		t.Errorf("rootdisk not replaced: %+v", disks)
	}
	if _, ok := byName["extra"]; !ok {
		t.Errorf("extra disk not appended: %+v", disks)
	}
	params, _, _ := unstructured.NestedSlice(got.Object, "parameters")
	found := map[string]map[string]any{}
	for _, p := range params {
		pm := p.(map[string]any)
		found[pm["name"].(string)] = pm
	}
	if found["EXTRA"] == nil || found["NAME"]["description"] != "the VM's name" || found["DATA_SOURCE_NAME"] == nil {
		t.Errorf("parameters %v", params)
	}
	// The result still processes, the new parameter taking its value.
	if objs, err := e.c.ProcessTemplate(ctx, name, map[string]string{"DATA_SOURCE_NAME": "golden"}); err != nil || len(objs) != 1 {
		t.Fatalf("process the modified template: %v", err)
	}

	// deleteDatavolumeTemplate takes the DataVolume templates with their
	// volumes and disks; the container disk stays.
	e.run(t, 0, "modify-vm-template", "--templateName="+name, "--deleteDatavolumeTemplate=true")
	got, _ = res.Get(ctx, name, metav1.GetOptions{})
	vm = vmOf(t, got)
	if len(vm.Spec.DataVolumeTemplates) != 0 {
		t.Errorf("DataVolume templates left: %v", vm.Spec.DataVolumeTemplates)
	}
	for _, v := range vm.Spec.Template.Spec.Volumes {
		if v.DataVolume != nil {
			t.Errorf("a DataVolume volume left: %+v", v)
		}
	}
	if _, ok := func() (kubevirtv1.Disk, bool) {
		for _, d := range vm.Spec.Template.Spec.Domain.Devices.Disks {
			if d.Name == "rootdisk" {
				return d, true
			}
		}
		return kubevirtv1.Disk{}, false
	}(); ok {
		t.Error("the rootdisk disk outlived its DataVolume template")
	}

	for _, bad := range [][]string{
		{"--templateName=" + name, "--memory=lots"},
		{"--templateName=" + name, "--cpuCores=-1"},
		{"--templateName=" + name, "--", "--array-param=disks", "{not json"},
		{"--templateName=" + name, "--", "--array-param=vmLabels", "novalue"},
		{"--templateName=" + name, "--", "--array-param=nosuch", "x"},
	} {
		e.run(t, 1, append([]string{"modify-vm-template"}, bad...)...)
	}

	e.run(t, 0, "modify-vm-template", "--templateName="+name, "--deleteTemplate=true", "--memory=9Gi")
	if _, err := res.Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("deleteTemplate: %v", err)
	}
}
