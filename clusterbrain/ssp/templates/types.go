package templates

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Stored templates: template.openshift.io/v1 is served by the brain's
// aggregated API (package templateapi), which keeps each Template as a
// StoredTemplate of the same shape (nodevirt.io/v1alpha1, a CRD), because
// processedtemplates must be served in the same group version as templates
// and an aggregated API shadows a CRD of its group version.
const (
	StorageGroup    = "nodevirt.io"
	StorageVersion  = "v1alpha1"
	StorageKind     = "StoredTemplate"
	StorageResource = "storedtemplates"
	Group           = "template.openshift.io"
	APIVersion      = "v1"
)

// StoredTemplate is the stored shape of a template.openshift.io/v1
// Template; it exists to give the storage CRD its schema.
type StoredTemplate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Message           string                 `json:"message,omitempty"`
	Objects           []runtime.RawExtension `json:"objects"`
	Parameters        []Parameter            `json:"parameters,omitempty"`
	Labels            map[string]string      `json:"labels,omitempty"`
}
