package hco

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// TestImportAllowedNetworksReachCDI: the HyperConverged's import network
// exceptions are copied onto the CDI CR, where the nodes read them, and
// are absent there when the HyperConverged has none.
func TestImportAllowedNetworksReachCDI(t *testing.T) {
	hc := &hcov1beta1.HyperConverged{ObjectMeta: metav1.ObjectMeta{Name: hcov1beta1.Name, Namespace: hcov1beta1.DefaultNamespace,
		Annotations: map[string]string{importstate.AnnImportAllowedNetworks: "10.0.0.0/8,192.168.122.1"}}}
	SetDefaults(hc)
	c, err := Render(hc, "v0")
	if err != nil {
		t.Fatal(err)
	}
	if got := c.CDI.Annotations[importstate.AnnImportAllowedNetworks]; got != "10.0.0.0/8,192.168.122.1" {
		t.Errorf("cdi annotation %q, want the HyperConverged's", got)
	}
	delete(hc.Annotations, importstate.AnnImportAllowedNetworks)
	if c, err = Render(hc, "v0"); err != nil {
		t.Fatal(err)
	}
	if got, ok := c.CDI.Annotations[importstate.AnnImportAllowedNetworks]; ok {
		t.Errorf("cdi annotation %q without one on the HyperConverged", got)
	}
}
