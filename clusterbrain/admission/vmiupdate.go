package admission

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
)

// VMIUpdateValidatorName is KubeVirt's name of the VMI update webhook.
const VMIUpdateValidatorName = "virtualmachineinstances-update-validator.kubevirt.io"

// KubeVirt's refusals of a user's VMI change, as virt-api words them.
const (
	SpecUpdateMessage     = "update of VMI object is restricted"
	LabelsUpdateMessage   = "modification of the following reserved kubevirt.io/ labels on a VMI object is prohibited"
	LabelsCreationMessage = "creation of the following reserved kubevirt.io/ labels on a VMI object is prohibited"
)

// reservedLabels are the VMI labels only KubeVirt's own components (here:
// the brain and the node agents) may set or change: the node a VMI is bound
// to above all, which decides which node agent runs it.
var reservedLabels = []string{
	kubevirtv1.CreatedByLabel, kubevirtv1.MigrationJobLabel, kubevirtv1.NodeNameLabel,
	kubevirtv1.MigrationTargetNodeNameLabel, kubevirtv1.NodeSchedulable, kubevirtv1.InstallStrategyLabel,
}

// privileged reports whether u is one of nodevirt's own daemons (the
// brain, or a node agent), which play KubeVirt's service accounts.
func privileged(u authenticationv1.UserInfo) bool {
	return rbac.IsBrain(u.Username, u.Groups) || rbac.IsNodeAgent(u.Username, u.Groups)
}

// notNodevirt is the match condition of webhooks that only restrict users:
// requests of the brain and the node agents are not sent (they update VMIs
// all the time: status, labels, finalizers).
func notNodevirt() []admissionregistrationv1.MatchCondition {
	return []admissionregistrationv1.MatchCondition{{Name: "not-a-nodevirt-daemon",
		Expression: fmt.Sprintf("!(request.userInfo.username in ['%s', '%s', '%s']) && (!has(request.userInfo.groups) || !('%s' in request.userInfo.groups || '%s' in request.userInfo.groups))",
			identity.BrainUser, rbac.ServiceAccountUser(rbac.InstallNamespace, rbac.BrainServiceAccount),
			rbac.ServiceAccountUser(rbac.InstallNamespace, rbac.NodeAgentServiceAccount), identity.BrainGroup, identity.NodesGroup)}}
}

func reserved(labels map[string]string) map[string]string {
	out := map[string]string{}
	for _, k := range reservedLabels {
		if v, ok := labels[k]; ok {
			out[k] = v
		}
	}
	return out
}

// validateReservedLabels refuses a user's VMI that carries reserved labels
// (a user binding a VMI to a node of their choice, past the scheduler).
func validateReservedLabels(vmi *kubevirtv1.VirtualMachineInstance, privileged bool) field.ErrorList {
	if privileged || len(reserved(vmi.Labels)) == 0 {
		return nil
	}
	return field.ErrorList{field.Forbidden(field.NewPath("metadata", "labels"), LabelsCreationMessage)}
}

// ValidateVMIUpdate checks a VMI update by a user who is not one of
// nodevirt's daemons, as KubeVirt's VMI update admitter does: the spec is
// immutable (changes go through subresources, which the brain makes) and
// the reserved labels cannot be added, changed or removed. Metadata
// otherwise (other labels, annotations, finalizers) stays the user's.
func ValidateVMIUpdate(old, cur *kubevirtv1.VirtualMachineInstance) field.ErrorList {
	var errs field.ErrorList
	if !equality.Semantic.DeepEqual(old.Spec, cur.Spec) {
		errs = append(errs, field.Forbidden(field.NewPath("spec"), SpecUpdateMessage))
	}
	if !equality.Semantic.DeepEqual(reserved(old.Labels), reserved(cur.Labels)) {
		errs = append(errs, field.Forbidden(field.NewPath("metadata", "labels"), LabelsUpdateMessage))
	}
	return errs
}

func admitVMIUpdate(_ context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	if privileged(req.UserInfo) {
		return Allow()
	}
	var old, cur kubevirtv1.VirtualMachineInstance
	if err := json.Unmarshal(req.Object.Raw, &cur); err != nil {
		return Denyf("decode virtualmachineinstance: %v", err)
	}
	if err := json.Unmarshal(req.OldObject.Raw, &old); err != nil {
		return Denyf("decode old virtualmachineinstance: %v", err)
	}
	if errs := ValidateVMIUpdate(&old, &cur); len(errs) > 0 {
		return DenyFields(errs)
	}
	return Allow()
}
