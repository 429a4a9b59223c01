package validator

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
)

// Names upstream uses.
const (
	WebhookName = "virtualmachine-validator.ssp.kubevirt.io"
	Path        = "/virtualmachine-validate"
	// AnnTemplateValidations holds a template's rules.
	AnnTemplateValidations = "validations"
	// AnnSkip on a VM turns validation off.
	AnnSkip = "vm.kubevirt.io/skip-validations"
	// Old spelling of the template namespace key.
	labelOldTemplateNamespace = "vm.kubevirt.io/template-namespace"
)

// TemplateGetter returns a template.openshift.io Template (decoded JSON);
// a missing one is (nil, nil): the VM is then checked against nothing.
type TemplateGetter interface {
	Template(ctx context.Context, namespace, name string) (map[string]any, error)
}

// StoredTemplates reads the templates as the template API stores them.
type StoredTemplates struct{ Dynamic dynamic.Interface }

var _ TemplateGetter = StoredTemplates{}

// Template implements TemplateGetter.
func (s StoredTemplates) Template(ctx context.Context, ns, name string) (map[string]any, error) {
	gvr := schema.GroupVersionResource{Group: templates.StorageGroup, Version: templates.StorageVersion, Resource: templates.StorageResource}
	got, err := s.Dynamic.Resource(gvr).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("template %s/%s: %w", ns, name, err)
	}
	return got.Object, nil
}

// Validator admits VMs.
type Validator struct {
	Templates TemplateGetter
	Log       *slog.Logger
}

// Admit checks a created or updated VM.
func (v *Validator) Admit(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vm map[string]any
	if err := json.Unmarshal(req.Object.Raw, &vm); err != nil {
		return deny(http.StatusBadRequest, metav1.StatusReasonBadRequest, "cannot decode the VirtualMachine: "+err.Error(), nil)
	}
	md, _ := vm["metadata"].(map[string]any)
	ann := stringMap(md["annotations"])
	if _, skip := ann[AnnSkip]; skip {
		return nil
	}
	source := "annotation " + templates.AnnValidations
	raw := ann[templates.AnnValidations]
	if raw == "" {
		labels := stringMap(md["labels"])
		name := firstOf(labels[templates.LabelVMTemplate], ann[templates.LabelVMTemplate])
		ns := firstOf(labels[templates.LabelVMTemplateNamespace], ann[templates.LabelVMTemplateNamespace],
			labels[labelOldTemplateNamespace], ann[labelOldTemplateNamespace])
		if name == "" || ns == "" {
			return nil
		}
		tmpl, err := v.Templates.Template(ctx, ns, name)
		if err != nil {
			return deny(http.StatusInternalServerError, metav1.StatusReasonInternalError, err.Error(), nil)
		}
		if tmpl == nil {
			return nil
		}
		tmd, _ := tmpl["metadata"].(map[string]any)
		raw = stringMap(tmd["annotations"])[AnnTemplateValidations]
		source = "template " + ns + "/" + name
	}
	rules, err := ParseRules(raw)
	if err != nil {
		return deny(http.StatusUnprocessableEntity, metav1.StatusReasonInvalid, source+": "+err.Error(), nil)
	}
	out := Evaluate(rules, vm)
	log := v.Log.With("namespace", req.Namespace, "name", req.Name)
	if len(out.Causes) > 0 {
		var msgs []string
		for _, c := range out.Causes {
			msgs = append(msgs, c.Field+": "+c.Message)
		}
		log.Info("vm refused by its validation rules", "source", source, "causes", msgs)
		return deny(http.StatusUnprocessableEntity, metav1.StatusReasonInvalid,
			"VirtualMachine "+req.Name+" breaks the validation rules of its "+source+": "+strings.Join(msgs, "; "), out.Causes)
	}
	if len(out.Warnings) > 0 {
		return &admissionv1.AdmissionResponse{Allowed: true, Warnings: out.Warnings}
	}
	return nil
}

func deny(code int32, reason metav1.StatusReason, msg string, causes []metav1.StatusCause) *admissionv1.AdmissionResponse {
	st := &metav1.Status{Status: metav1.StatusFailure, Code: code, Reason: reason, Message: msg}
	if len(causes) > 0 {
		st.Details = &metav1.StatusDetails{Causes: causes}
	}
	return &admissionv1.AdmissionResponse{Allowed: false, Result: st}
}

func stringMap(v any) map[string]string {
	out := map[string]string{}
	m, _ := v.(map[string]any)
	for k, e := range m {
		if s, ok := e.(string); ok {
			out[k] = s
		}
	}
	return out
}

func firstOf(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// Register returns the admission.Contributor that serves the validator on
// the brain's webhook server for VMs that carry rules or name a template.
func Register(cfg *rest.Config) admission.Contributor {
	return func(s *admission.Server) error {
		dyn, err := dynamic.NewForConfig(cfg)
		if err != nil {
			return fmt.Errorf("template validator: %w", err)
		}
		v := &Validator{Templates: StoredTemplates{Dynamic: dyn}, Log: s.Deps().Log.With("role", "template-validator")}
		s.Register(Webhook(v))
		return nil
	}
}

// Webhook is the validator's entry in the brain's configurations.
func Webhook(v *Validator) admission.Webhook {
	ops := []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update}
	return admission.Webhook{
		Name: WebhookName, Path: Path,
		Rules: []admissionregistrationv1.RuleWithOperations{{Operations: ops, Rule: admissionregistrationv1.Rule{
			APIGroups: []string{"kubevirt.io"}, APIVersions: []string{"v1"}, Resources: []string{"virtualmachines"}}}},
		// Only VMs that carry rules or name a template are sent.
		MatchConditions: []admissionregistrationv1.MatchCondition{{Name: "has-rules-or-template",
			Expression: "(has(object.metadata.annotations) && ('" + templates.AnnValidations + "' in object.metadata.annotations || '" +
				templates.LabelVMTemplate + "' in object.metadata.annotations)) || (has(object.metadata.labels) && '" +
				templates.LabelVMTemplate + "' in object.metadata.labels)"}},
		Admit: v.Admit,
	}
}
