package hco

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// TestTektonFieldsReachTheSSP: deployTektonTaskResources and the Tekton
// namespaces become the SSP's gate and namespaces (the SSP role deploys
// from them); without the gate the SSP asks for nothing.
func TestTektonFieldsReachTheSSP(t *testing.T) {
	hc := &hcov1beta1.HyperConverged{ObjectMeta: metav1.ObjectMeta{Name: hcov1beta1.Name, Namespace: hcov1beta1.DefaultNamespace}}
	SetDefaults(hc)
	c, err := Render(hc, "v0")
	if err != nil {
		t.Fatal(err)
	}
	if fg := c.SSP.Spec.FeatureGates; fg != nil && fg.DeployTektonTaskResources {
		t.Error("the SSP deploys pipeline tasks nobody asked for")
	}
	on, pns, tns := true, "pipelines", "tasks"
	hc.Spec.FeatureGates.DeployTektonTaskResources = &on
	hc.Spec.TektonPipelinesNamespace, hc.Spec.TektonTasksNamespace = &pns, &tns
	if c, err = Render(hc, "v0"); err != nil {
		t.Fatal(err)
	}
	s := c.SSP.Spec
	if s.FeatureGates == nil || !s.FeatureGates.DeployTektonTaskResources || s.TektonPipelines.Namespace != pns || s.TektonTasks.Namespace != tns {
		t.Errorf("ssp spec %+v %+v %+v", s.FeatureGates, s.TektonPipelines, s.TektonTasks)
	}
}
