package api

import metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

// Condition is the condition shape of operator-managed resources
// (github.com/openshift/custom-resource-status), used by CNAO, HPP and SSP.
type Condition struct {
	Type               string      `json:"type"`
	Status             string      `json:"status"`
	Reason             string      `json:"reason,omitempty"`
	Message            string      `json:"message,omitempty"`
	LastHeartbeatTime  metav1.Time `json:"lastHeartbeatTime,omitempty"`
	LastTransitionTime metav1.Time `json:"lastTransitionTime,omitempty"`
}

// OperatorStatus is the status every operand resource reports.
type OperatorStatus struct {
	Phase              string      `json:"phase,omitempty"`
	Conditions         []Condition `json:"conditions,omitempty"`
	OperatorVersion    string      `json:"operatorVersion,omitempty"`
	TargetVersion      string      `json:"targetVersion,omitempty"`
	ObservedVersion    string      `json:"observedVersion,omitempty"`
	ObservedGeneration int64       `json:"observedGeneration,omitempty"`
}
