package vmclone

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/validation/field"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
)

// WebhookPath is the clone validator's path.
const WebhookPath = "/validate/virtualmachineclones"

// Webhooks validates clones as KubeVirt's virt-api does: a source that is
// a VirtualMachine or a VirtualMachineSnapshot and exists, a target that
// is a VirtualMachine other than the source, filters that are not empty,
// new MACs only for the source's interfaces, and an immutable spec.
func Webhooks() admission.Contributor {
	return func(s *admission.Server) error {
		virt := s.Deps().Virt
		if virt == nil {
			return fmt.Errorf("vmclone webhooks: virt client is required")
		}
		s.Register(admission.Webhook{Name: "virtualmachineclone-validator.kubevirt.io", Path: WebhookPath,
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
				Rule: admissionregistrationv1.Rule{APIGroups: []string{clonev1beta1.SchemeGroupVersion.Group}, APIVersions: []string{"*"},
					Resources: []string{"virtualmachineclones"}}}},
			Admit: func(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
				return admit(ctx, virt, req)
			}})
		return nil
	}
}

func admit(ctx context.Context, virt *client.Set, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vc clonev1beta1.VirtualMachineClone
	if err := json.Unmarshal(req.Object.Raw, &vc); err != nil {
		return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode clone: %v", err))
	}
	if req.Operation == admissionv1.Update {
		var old clonev1beta1.VirtualMachineClone
		if err := json.Unmarshal(req.OldObject.Raw, &old); err != nil {
			return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode old clone: %v", err))
		}
		if !equality.Semantic.DeepEqual(old.Spec, vc.Spec) {
			return admission.DenyFields(field.ErrorList{field.Forbidden(field.NewPath("spec"), "spec is immutable after creation")})
		}
		return admission.Allow()
	}
	spec := field.NewPath("spec")
	var errs field.ErrorList
	src := vc.Spec.Source
	var srcVM *kubevirtv1.VirtualMachine
	if src == nil {
		return admission.DenyFields(field.ErrorList{field.Required(spec.Child("source"), "source spec is mandatory")})
	}
	group := ""
	if src.APIGroup != nil {
		group = *src.APIGroup
	}
	switch {
	case src.Kind == "VirtualMachine" && group == kubevirtv1.GroupVersion.Group:
		vm, err := virt.VMs.Get(ctx, req.Namespace, src.Name)
		switch {
		case apierrors.IsNotFound(err):
			errs = append(errs, field.Invalid(spec.Child("source", "name"), src.Name, fmt.Sprintf("VirtualMachine %s does not exist", src.Name)))
		case err != nil:
			return admission.Deny(http.StatusInternalServerError, err.Error())
		default:
			srcVM = vm
		}
	case src.Kind == "VirtualMachineSnapshot" && group == snapv1beta1.SchemeGroupVersion.Group:
		if _, err := virt.VMSnapshots.Get(ctx, req.Namespace, src.Name); apierrors.IsNotFound(err) {
			errs = append(errs, field.Invalid(spec.Child("source", "name"), src.Name, fmt.Sprintf("VirtualMachineSnapshot %s does not exist", src.Name)))
		} else if err != nil {
			return admission.Deny(http.StatusInternalServerError, err.Error())
		}
	default:
		errs = append(errs, field.NotSupported(spec.Child("source", "kind"), src.Kind,
			[]string{"VirtualMachine (kubevirt.io)", "VirtualMachineSnapshot (snapshot.kubevirt.io)"}))
	}
	if t := vc.Spec.Target; t != nil {
		if t.Kind != "VirtualMachine" || (t.APIGroup != nil && *t.APIGroup != kubevirtv1.GroupVersion.Group) {
			errs = append(errs, field.NotSupported(spec.Child("target", "kind"), t.Kind, []string{"VirtualMachine"}))
		}
		if src.Kind == "VirtualMachine" && t.Name == src.Name {
			errs = append(errs, field.Invalid(spec.Child("target", "name"), t.Name, "target name cannot be equal to source name"))
		}
	}
	for _, f := range []struct {
		path    *field.Path
		filters []string
	}{
		{spec.Child("labelFilters"), vc.Spec.LabelFilters}, {spec.Child("annotationFilters"), vc.Spec.AnnotationFilters},
		{spec.Child("template", "labelFilters"), vc.Spec.Template.LabelFilters},
		{spec.Child("template", "annotationFilters"), vc.Spec.Template.AnnotationFilters},
	} {
		for i, x := range f.filters {
			if strings.TrimPrefix(x, "!") == "" {
				errs = append(errs, field.Invalid(f.path.Index(i), x, "filter is empty"))
			}
		}
	}
	if srcVM != nil && srcVM.Spec.Template != nil {
		ifaces := map[string]bool{}
		for _, i := range srcVM.Spec.Template.Spec.Domain.Devices.Interfaces {
			ifaces[i.Name] = true
		}
		for name := range vc.Spec.NewMacAddresses {
			if !ifaces[name] {
				errs = append(errs, field.Invalid(spec.Child("newMacAddresses").Key(name), name,
					fmt.Sprintf("interface %s does not exist in the source VM", name)))
			}
		}
	}
	if len(errs) > 0 {
		return admission.DenyFields(errs)
	}
	return admission.Allow()
}
