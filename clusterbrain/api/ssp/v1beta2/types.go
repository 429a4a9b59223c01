// Package v1beta2 is ssp.kubevirt.io/v1beta2: the SSP resource that deploys
// common templates, boot sources and the template validator.
package v1beta2

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/nodevirt/nodevirt/clusterbrain/api"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// SchemeGroupVersion is the group and version of this package.
var SchemeGroupVersion = schema.GroupVersion{Group: "ssp.kubevirt.io", Version: "v1beta2"}

// SSP is namespaced.
type SSP struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              SSPSpec            `json:"spec,omitempty"`
	Status            api.OperatorStatus `json:"status,omitempty"`
}

// SSPList is a list of SSP.
type SSPList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []SSP `json:"items"`
}

// SSPSpec configures the scheduling, scale and performance add-ons.
type SSPSpec struct {
	TemplateValidator  *TemplateValidator             `json:"templateValidator,omitempty"`
	CommonTemplates    CommonTemplates                `json:"commonTemplates"`
	TLSSecurityProfile *hcov1beta1.TLSSecurityProfile `json:"tlsSecurityProfile,omitempty"`
	TektonPipelines    *TektonObjects                 `json:"tektonPipelines,omitempty"`
	TektonTasks        *TektonObjects                 `json:"tektonTasks,omitempty"`
	FeatureGates       *SSPFeatureGates               `json:"featureGates,omitempty"`
}

// TemplateValidator configures the template validator.
type TemplateValidator struct {
	Replicas  *int32                    `json:"replicas,omitempty"`
	Placement *hcov1beta1.NodePlacement `json:"placement,omitempty"`
}

// CommonTemplates says where templates and boot sources live.
type CommonTemplates struct {
	Namespace               string                              `json:"namespace"`
	DataImportCronTemplates []hcov1beta1.DataImportCronTemplate `json:"dataImportCronTemplates,omitempty"`
}

// TektonObjects is where pipeline objects are deployed.
type TektonObjects struct {
	Namespace string `json:"namespace,omitempty"`
}

// SSPFeatureGates are SSP's optional features.
type SSPFeatureGates struct {
	DeployTektonTaskResources bool  `json:"deployTektonTaskResources,omitempty"`
	DeployVmConsoleProxy      bool  `json:"deployVmConsoleProxy,omitempty"`
	DeployCommonInstancetypes *bool `json:"deployCommonInstancetypes,omitempty"`
}

// DeepCopyObject implements runtime.Object.
func (in *SSP) DeepCopyObject() runtime.Object {
	out := new(SSP)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *SSPList) DeepCopyObject() runtime.Object {
	out := new(SSPList)
	api.DeepCopyJSON(in, out)
	return out
}
