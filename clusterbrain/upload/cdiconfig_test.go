package upload

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestProxyURLInCDIConfig: without the CDIConfig API nothing is published;
// once it is served, CDIConfig "config" is created with status.uploadProxyURL
// naming the proxy (where virtctl image-upload looks for it), and a second
// publication changes nothing.
func TestProxyURLInCDIConfig(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	want, err := e.srv.ProxyURL()
	if err != nil {
		t.Fatal(err)
	}
	if want != "https://"+e.srv.ProxyAddr() {
		t.Fatalf("ProxyURL() = %q, want https://%s (the proxy listens on that address)", want, e.srv.ProxyAddr())
	}
	if !e.srv.servesCDIConfig() {
		if published, err := e.srv.publishProxyURL(ctx); published || err != nil {
			t.Fatalf("without the CDIConfig API: published %v, err %v; want nothing done", published, err)
		}
		installCDIConfigCRD(t, e)
	}
	if published, err := e.srv.publishProxyURL(ctx); !published || err != nil {
		t.Fatalf("publishProxyURL: published %v, err %v", published, err)
	}
	rc := e.kube.Discovery().RESTClient()
	get := func() (url, rv string) {
		raw, err := rc.Get().AbsPath(cdiConfigPath).DoRaw(ctx)
		if err != nil {
			t.Fatalf("get cdiconfig: %v", err)
		}
		var obj struct {
			Metadata metav1.ObjectMeta `json:"metadata"`
			Status   struct {
				UploadProxyURL string `json:"uploadProxyURL"`
			} `json:"status"`
		}
		if err := json.Unmarshal(raw, &obj); err != nil {
			t.Fatal(err)
		}
		return obj.Status.UploadProxyURL, obj.Metadata.ResourceVersion
	}
	got, rv := get()
	if got != want {
		t.Fatalf("cdiconfig status.uploadProxyURL = %q, want %q", got, want)
	}
	if published, err := e.srv.publishProxyURL(ctx); !published || err != nil {
		t.Fatalf("second publishProxyURL: published %v, err %v", published, err)
	}
	if _, rv2 := get(); rv2 != rv {
		t.Errorf("an unchanged url was written again (resourceVersion %s -> %s)", rv, rv2)
	}
}

// installCDIConfigCRD serves cdiconfigs as CDI's CRD does: cluster scoped,
// with a status subresource.
func installCDIConfigCRD(t *testing.T, e env) {
	t.Helper()
	ctx := context.Background()
	crd := &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "cdiconfigs.cdi.kubevirt.io"},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: "cdi.kubevirt.io", Scope: apiextensionsv1.ClusterScoped,
			Names: apiextensionsv1.CustomResourceDefinitionNames{Plural: "cdiconfigs", Singular: "cdiconfig", Kind: "CDIConfig", ListKind: "CDIConfigList"},
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{Name: "v1beta1", Served: true, Storage: true,
				Subresources: &apiextensionsv1.CustomResourceSubresources{Status: &apiextensionsv1.CustomResourceSubresourceStatus{}},
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Type: "object", XPreserveUnknownFields: ptrTo(true)}}}},
		},
	}
	cs := apiextensionsclient.NewForConfigOrDie(e.cp.RestConfig)
	if _, err := cs.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	testkit.Until(t, 30*time.Second, "the CDIConfig CRD served", e.srv.servesCDIConfig)
}

func ptrTo[T any](v T) *T { return &v }
