package hcoconvert

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/crds"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// TestV1SampleAppliesUnchanged serves the conversion webhook on the brain's
// webhook server, creates HCO's own v1 sample CR through the real API
// server and reads it back as v1beta1 (what the brain reconciles) and v1.
func TestV1SampleAppliesUnchanged(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	ext := apiextensionsclient.NewForConfigOrDie(cp.RestConfig)
	var hco []crds.Kind
	for _, k := range crds.Catalog() {
		if k.Kind == "HyperConverged" {
			hco = append(hco, k)
		}
	}
	if err := crds.Install(ctx, ext, hco); err != nil {
		t.Fatal(err)
	}
	kube := cp.Clientset(t)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("HCO_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	s, err := admission.New(admission.Config{Addr: "127.0.0.1:0", Namespace: ns}, admission.Deps{Kube: kube, Virt: virt, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	if err := Register(cp.RestConfig)(s); err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Run(runCtx) }()
	t.Cleanup(func() {
		_ = admission.Uninstall(context.Background(), kube, ns)
		cancel()
		<-done
	})
	<-s.Ready()

	sample := load(t, "../../../shared/compat/hco/hco.cr.v1.yaml")
	dyn := dynamic.NewForConfigOrDie(cp.RestConfig)
	v1 := dyn.Resource(schema.GroupVersionResource{Group: "hco.kubevirt.io", Version: "v1", Resource: "hyperconvergeds"}).Namespace(ns)
	var created *unstructured.Unstructured
	// The CRD's conversion settles a moment after the server publishes,
	// and until kube-apiserver's handler follows the CRD a v1 create is
	// stored unconverted (its v1-only layout dropped): such a copy is
	// deleted and the create tried again.
	testkit.Eventually(t, 60*time.Second, "creating the v1 sample through the conversion", func() (err error) {
		created, err = v1.Create(ctx, &unstructured.Unstructured{Object: deepCopy(sample)}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		stored, err := virt.HyperConvergeds.Get(ctx, ns, created.GetName())
		if err == nil && stored.Spec.UninstallStrategy != "" {
			return nil
		}
		// No finalizer here (no brain runs): the delete is immediate.
		if derr := v1.Delete(ctx, created.GetName(), metav1.DeleteOptions{}); derr != nil {
			return fmt.Errorf("stored without conversion (%v); delete: %w", err, derr)
		}
		return fmt.Errorf("stored without conversion (%v)", err)
	})
	t.Cleanup(func() { _ = v1.Delete(context.Background(), created.GetName(), metav1.DeleteOptions{}) })

	beta, err := virt.HyperConvergeds.Get(ctx, ns, created.GetName())
	if err != nil {
		t.Fatal(err)
	}
	if beta.Spec.UninstallStrategy != "BlockUninstallIfWorkloadsExist" ||
		beta.Spec.EnableCommonBootImageImport == nil || !*beta.Spec.EnableCommonBootImageImport ||
		beta.Spec.ResourceRequirements == nil || beta.Spec.ResourceRequirements.VmiCPUAllocationRatio == nil ||
		*beta.Spec.ResourceRequirements.VmiCPUAllocationRatio != 10 ||
		beta.Spec.LiveMigrationConfig.AllowWorkloadDisruption == nil ||
		beta.Spec.CertConfig.CA.Duration == nil || beta.Spec.CertConfig.CA.Duration.Duration != 48*time.Hour {
		t.Errorf("stored v1beta1 does not carry the sample's settings: %+v", beta.Spec)
	}

	got, err := v1.Get(ctx, created.GetName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !sameSpec(t, got.Object["spec"], sample["spec"]) {
		t.Errorf("v1 read back differs:\n got %v\nwant %v", got.Object["spec"], sample["spec"])
	}
	if _, has := got.GetAnnotations()[V1OnlyAnnotation]; has {
		t.Errorf("the v1-only annotation shows on v1: %v", got.GetAnnotations())
	}

	// An edit through v1beta1 shows through v1, and v1-only fields survive it.
	beta.Spec.UninstallStrategy = "RemoveWorkloads"
	if _, err := virt.HyperConvergeds.Update(ctx, beta); err != nil {
		t.Fatal(err)
	}
	got, err = v1.Get(ctx, created.GetName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v := at(got.Object, "spec", "deployment", "uninstallStrategy"); v != "RemoveWorkloads" {
		t.Errorf("v1beta1 edit seen through v1: %v", v)
	}
	if v := at(got.Object, "spec", "deployment", "deployNetworkResourcesInjector"); v != true {
		t.Errorf("v1-only field lost by a v1beta1 update: %v", v)
	}
}

func sameSpec(t *testing.T, a, b any) bool {
	t.Helper()
	return jsonOf(t, a) == jsonOf(t, b)
}
