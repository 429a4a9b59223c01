package admission

import (
	"encoding/json"
	"fmt"
	"net/http"

	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// PatchOp is one JSON patch operation.
type PatchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// Allow admits the request unchanged.
func Allow() *admissionv1.AdmissionResponse { return &admissionv1.AdmissionResponse{Allowed: true} }

// Deny refuses the request with msg.
func Deny(code int32, msg string) *admissionv1.AdmissionResponse {
	return &admissionv1.AdmissionResponse{Result: &metav1.Status{Status: metav1.StatusFailure, Code: code, Message: msg,
		Reason: metav1.StatusReasonInvalid}}
}

// Denyf refuses the request with a formatted message (422).
func Denyf(format string, args ...any) *admissionv1.AdmissionResponse {
	return Deny(http.StatusUnprocessableEntity, fmt.Sprintf(format, args...))
}

// DenyFields refuses the request, naming each offending field as KubeVirt
// does ("spec.domain.devices.disks[0].name: ...").
func DenyFields(errs field.ErrorList) *admissionv1.AdmissionResponse {
	resp := Deny(http.StatusUnprocessableEntity, errs.ToAggregate().Error())
	details := &metav1.StatusDetails{}
	for _, e := range errs {
		details.Causes = append(details.Causes, metav1.StatusCause{Type: metav1.CauseType(e.Type), Message: e.ErrorBody(), Field: e.Field})
	}
	resp.Result.Details = details
	return resp
}

// Patch admits the request with ops applied (nil ops: unchanged).
func Patch(ops []PatchOp) *admissionv1.AdmissionResponse {
	if len(ops) == 0 {
		return Allow()
	}
	data, err := json.Marshal(ops)
	if err != nil {
		return Deny(http.StatusInternalServerError, fmt.Sprintf("encode patch: %v", err))
	}
	pt := admissionv1.PatchTypeJSONPatch
	return &admissionv1.AdmissionResponse{Allowed: true, Patch: data, PatchType: &pt}
}
