package admission

import (
	"fmt"
	"net/http"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
)

// Names of the VMI webhooks, as the API server quotes them in a denial.
const (
	VMIMutatorName   = "virtualmachineinstances-mutator.kubevirt.io"
	VMIValidatorName = "virtualmachineinstances-create-validator.kubevirt.io"
)

// notTheBrain is the match condition of the VMI webhooks: requests of the
// brain's own user (identity.BrainUser) are not sent to them. Every VMI that
// user creates comes from the VM controller or the replica set controller
// (package replicas), which apply both webhooks in process with
// AdmitVMICreate first; anyone else's VMI create (kubectl create vmi) is
// still sent to both.
func notTheBrain() []admissionregistrationv1.MatchCondition {
	return []admissionregistrationv1.MatchCondition{{Name: "not-the-cluster-brain",
		Expression: fmt.Sprintf("request.userInfo.username != '%s'", identity.BrainUser)}}
}

// AdmitVMICreate does to vmi, in process, what the two VMI webhooks do to a
// create sent to them: the mutating webhook's defaults (mem's memory
// request, DefaultVMISpec, which settles in one pass, cpu's default
// model and ro's maxSockets for CPU hotplug), then the create
// validation (cpu's obsolete models refused). A refusal is the
// error the API server returns when the validating webhook denies the
// create: an *apierrors.StatusError
// with the same code, causes and message ("admission webhook
// \"virtualmachineinstances-create-validator.kubevirt.io\" denied the
// request: spec.domain...").
func AdmitVMICreate(vmi *kubevirtv1.VirtualMachineInstance, cpu cpumodel.Cluster, mem overcommit.Memory, ro rollout.Cluster) error {
	mem.Apply(&vmi.Spec) // before defaultVMISpec, which makes the request the guest's size
	defaultVMISpec(&vmi.Spec)
	cpu.Apply(&vmi.Spec)
	ro.SetupCPUHotplug(&vmi.Spec)
	errs := ValidateVMISpec(field.NewPath("spec"), &vmi.Spec, false)
	if errs = append(errs, cpu.Check(field.NewPath("spec"), &vmi.Spec)...); len(errs) > 0 {
		return deniedBy(VMIValidatorName, DenyFields(errs).Result)
	}
	return nil
}

// deniedBy is the API server's error for webhook's denial with result.
func deniedBy(webhook string, result *metav1.Status) *apierrors.StatusError {
	st := *result
	if st.Code < http.StatusBadRequest {
		st.Code = http.StatusBadRequest
	}
	st.Status = metav1.StatusFailure
	st.Message = fmt.Sprintf("admission webhook %q denied the request: %s", webhook, st.Message)
	return &apierrors.StatusError{ErrStatus: st}
}
