package crds

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/nodevirt/nodevirt/test/controlplane"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

func TestSchemasAreStructuralAndSmall(t *testing.T) {
	for _, k := range Catalog() {
		data, err := json.Marshal(k.Definition())
		if err != nil {
			t.Fatal(err)
		}
		if len(data) > 1<<20 {
			t.Errorf("%s: crd is %d bytes, over 1 MiB", k.Kind, len(data))
		}
	}
}

func install(t *testing.T) (*controlplane.ControlPlane, dynamic.Interface) {
	t.Helper()
	cp := controlplane.Shared(t)
	ctx := context.Background()
	if err := Install(ctx, apiextensionsclient.NewForConfigOrDie(cp.RestConfig), Catalog()); err != nil {
		t.Fatal(err)
	}
	return cp, dynamic.NewForConfigOrDie(cp.RestConfig)
}

func TestInstallIsIdempotentAndServesShortNames(t *testing.T) {
	cp, _ := install(t)
	if err := Install(context.Background(), apiextensionsclient.NewForConfigOrDie(cp.RestConfig), Catalog()); err != nil {
		t.Fatalf("second install: %v", err)
	}
	_, lists, err := cp.Clientset(t).Discovery().ServerGroupsAndResources()
	if err != nil {
		t.Fatal(err)
	}
	short := map[string]bool{}
	for _, l := range lists {
		for _, r := range l.APIResources {
			for _, s := range r.ShortNames {
				short[s] = true
			}
		}
	}
	for _, want := range []string{"vm", "vmi", "vmim", "kv", "dv", "hco", "net-attach-def", "vmcf", "vmpref"} {
		if !short[want] {
			t.Errorf("short name %q not served", want)
		}
	}
}

func TestUnknownFieldsArePrunedAndWrongTypesRejected(t *testing.T) {
	cp, dyn := install(t)
	ns := cp.Namespace(t)
	vmis := dyn.Resource(schema.GroupVersionResource{Group: "kubevirt.io", Version: "v1", Resource: "virtualmachineinstances"}).Namespace(ns)
	obj := &unstructured.Unstructured{}
	err := json.Unmarshal([]byte(`{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachineInstance",
		"metadata":{"name":"probe"},
		"spec":{"bogusField":"x","domain":{"devices":{},"resources":{"requests":{"memory":"64Mi"}}}}}`), &obj.Object)
	if err != nil {
		t.Fatal(err)
	}
	got, err := vmis.Create(context.Background(), obj, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create vmi: %v", err)
	}
	if _, found, _ := unstructured.NestedFieldNoCopy(got.Object, "spec", "bogusField"); found {
		t.Error("unknown field spec.bogusField was kept, want pruned")
	}
	if mem, _, _ := unstructured.NestedString(got.Object, "spec", "domain", "resources", "requests", "memory"); mem != "64Mi" {
		t.Errorf("memory request = %q, want 64Mi kept", mem)
	}
	bad := &unstructured.Unstructured{}
	_ = json.Unmarshal([]byte(`{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachine",
		"metadata":{"name":"bad"},"spec":{"running":"yes","template":{"spec":{"domain":{"devices":{}}}}}}`), &bad.Object)
	vms := dyn.Resource(schema.GroupVersionResource{Group: "kubevirt.io", Version: "v1", Resource: "virtualmachines"}).Namespace(ns)
	_, err = vms.Create(context.Background(), bad, metav1.CreateOptions{})
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "spec.running") {
		t.Fatalf("vm with spec.running a string: err = %v, want Invalid naming spec.running", err)
	}
}
