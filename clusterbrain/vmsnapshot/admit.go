package vmsnapshot

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
)

// Webhook paths.
const (
	SnapshotPath = "/validate/virtualmachinesnapshots"
	RestorePath  = "/validate/virtualmachinerestores"
)

// Webhooks validates snapshots and restores as KubeVirt's virt-api does:
// the source and target must be VirtualMachines (kubevirt.io), the spec is
// immutable, a restore names an existing snapshot, and one target takes
// one restore at a time.
func Webhooks() admission.Contributor {
	return func(s *admission.Server) error {
		virt := s.Deps().Virt
		if virt == nil {
			return fmt.Errorf("vmsnapshot webhooks: virt client is required")
		}
		cu := []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update}
		rule := func(resource string) []admissionregistrationv1.RuleWithOperations {
			return []admissionregistrationv1.RuleWithOperations{{Operations: cu, Rule: admissionregistrationv1.Rule{
				APIGroups: []string{snapv1beta1.SchemeGroupVersion.Group}, APIVersions: []string{"*"}, Resources: []string{resource}}}}
		}
		s.Register(admission.Webhook{Name: "virtualmachinesnapshot-validator.snapshot.kubevirt.io", Path: SnapshotPath,
			Rules: rule("virtualmachinesnapshots"), Admit: admitSnapshot})
		s.Register(admission.Webhook{Name: "virtualmachinerestore-validator.snapshot.kubevirt.io", Path: RestorePath,
			Rules: rule("virtualmachinerestores"), Admit: func(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
				return admitRestore(ctx, virt, req)
			}})
		return nil
	}
}

// checkRef refuses a reference that is not kind in group.
func checkRef(path *field.Path, ref corev1.TypedLocalObjectReference, group, kind string) field.ErrorList {
	var errs field.ErrorList
	switch {
	case ref.APIGroup == nil:
		errs = append(errs, field.Invalid(path.Child("apiGroup"), nil, "missing apiGroup"))
	case *ref.APIGroup != group:
		errs = append(errs, field.Invalid(path.Child("apiGroup"), *ref.APIGroup, "invalid apiGroup"))
	}
	if ref.Kind != kind {
		errs = append(errs, field.Invalid(path.Child("kind"), ref.Kind, "invalid kind"))
	}
	if ref.Name == "" {
		errs = append(errs, field.Required(path.Child("name"), "name is required"))
	}
	return errs
}

func decode[T any](raw []byte) (*T, *admissionv1.AdmissionResponse) {
	obj := new(T)
	if err := json.Unmarshal(raw, obj); err != nil {
		return nil, admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode: %v", err))
	}
	return obj, nil
}

// sameSpec refuses an update that changes spec(obj), KubeVirt's message.
func sameSpec[T any](req *admissionv1.AdmissionRequest, obj *T, spec func(*T) any) *admissionv1.AdmissionResponse {
	old, deny := decode[T](req.OldObject.Raw)
	if deny != nil {
		return deny
	}
	if !equality.Semantic.DeepEqual(spec(old), spec(obj)) {
		return admission.DenyFields(field.ErrorList{field.Forbidden(field.NewPath("spec"), "spec in immutable after creation")})
	}
	return admission.Allow()
}

func admitSnapshot(_ context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	s, deny := decode[snapv1beta1.VirtualMachineSnapshot](req.Object.Raw)
	if deny != nil {
		return deny
	}
	if req.Operation == admissionv1.Update {
		return sameSpec(req, s, func(o *snapv1beta1.VirtualMachineSnapshot) any { return o.Spec })
	}
	if errs := checkRef(field.NewPath("spec", "source"), s.Spec.Source, kubevirtv1.GroupVersion.Group, "VirtualMachine"); len(errs) > 0 {
		return admission.DenyFields(errs)
	}
	return admission.Allow()
}

func admitRestore(ctx context.Context, virt *client.Set, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	r, deny := decode[snapv1beta1.VirtualMachineRestore](req.Object.Raw)
	if deny != nil {
		return deny
	}
	if req.Operation == admissionv1.Update {
		return sameSpec(req, r, func(o *snapv1beta1.VirtualMachineRestore) any { return o.Spec })
	}
	ns := req.Namespace
	errs := checkRef(field.NewPath("spec", "target"), r.Spec.Target, kubevirtv1.GroupVersion.Group, "VirtualMachine")
	snapPath := field.NewPath("spec", "virtualMachineSnapshotName")
	if r.Spec.VirtualMachineSnapshotName == "" {
		errs = append(errs, field.Required(snapPath, "missing virtualMachineSnapshotName"))
	} else if _, err := virt.VMSnapshots.Get(ctx, ns, r.Spec.VirtualMachineSnapshotName); apierrors.IsNotFound(err) {
		errs = append(errs, field.Invalid(snapPath, r.Spec.VirtualMachineSnapshotName,
			fmt.Sprintf("VirtualMachineSnapshot %q does not exist", r.Spec.VirtualMachineSnapshotName)))
	} else if err != nil {
		return admission.Deny(http.StatusInternalServerError, err.Error())
	}
	if p := r.Spec.VolumeRestorePolicy; p != nil && *p == snapv1beta1.VolumeRestorePolicyInPlace {
		errs = append(errs, field.NotSupported(field.NewPath("spec", "volumeRestorePolicy"), string(*p),
			[]string{string(snapv1beta1.VolumeRestorePolicyRandomizeNames), string(snapv1beta1.VolumeRestorePolicyPrefixTargetName)}))
	}
	if len(errs) > 0 {
		return admission.DenyFields(errs)
	}
	restores, err := virt.VMRestores.List(ctx, ns, metav1.ListOptions{})
	if err != nil {
		return admission.Deny(http.StatusInternalServerError, err.Error())
	}
	for _, other := range restores {
		if other.Name != r.Name && other.Spec.Target.Name == r.Spec.Target.Name && !restoreComplete(other) && !restoreFailed(other) {
			return admission.DenyFields(field.ErrorList{field.Forbidden(field.NewPath("spec", "target"),
				fmt.Sprintf("VirtualMachineRestore %q in progress", other.Name))})
		}
	}
	return admission.Allow()
}
