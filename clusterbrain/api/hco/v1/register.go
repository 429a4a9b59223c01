package v1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// AddToScheme registers this group's kinds.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &HyperConverged{}, &HyperConvergedList{})
	metav1.AddToGroupVersion(s, SchemeGroupVersion)
	return nil
}
