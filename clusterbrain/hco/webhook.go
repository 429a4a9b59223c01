package hco

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"reflect"
	"slices"
	"sort"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8slabels "k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/hcoconvert"
)

// Webhook paths, as upstream's hco-webhook serves them.
const (
	ValidatePath  = "/validate-hco-kubevirt-io-v1beta1-hyperconverged"
	NamespacePath = "/mutate-ns-hco-kubevirt-io"
)

// Upstream's messages.
const (
	nsDeletionDenied       = "HyperConverged CR is still present, please remove it before deleting the containing hcoNamespace"
	fgDeprecationWarning   = "spec.featureGates.%s is deprecated and ignored. It will be removed in a future version;"
	fgMovedWarning         = "spec.featureGates.%[1]s is deprecated and ignored. It will removed in a future version; use spec.%[1]s instead"
	minimalCertDuration    = 10 * time.Minute
	http2CipherRequirement = "http2: TLSConfig.CipherSuites is missing an HTTP/2-required AES_128_GCM_SHA256 cipher (need at least one of ECDHE-RSA-AES128-GCM-SHA256 or ECDHE-ECDSA-AES128-GCM-SHA256)"
)

// Webhook is the hco-webhook: it validates the HyperConverged, guards its
// deletion by the uninstall strategy, and guards its namespace's deletion.
type Webhook struct {
	// Virt lists and deletes the workloads; nil refuses deletions it
	// cannot check.
	Virt *client.Set
	Log  *slog.Logger
}

// ValidateHyperConverged admits creates, updates and deletes of
// HyperConverged CRs.
func (w *Webhook) ValidateHyperConverged(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	switch req.Operation {
	case admissionv1.Create, admissionv1.Update:
		hc := &hcov1beta1.HyperConverged{}
		if err := json.Unmarshal(req.Object.Raw, hc); err != nil {
			return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode hyperconverged: %v", err))
		}
		var old *hcov1beta1.HyperConverged
		if req.Operation == admissionv1.Update {
			old = &hcov1beta1.HyperConverged{}
			if err := json.Unmarshal(req.OldObject.Raw, old); err != nil {
				return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode old hyperconverged: %v", err))
			}
			// Status, finalizer and label writes need no validation.
			if reflect.DeepEqual(old.Spec, hc.Spec) && reflect.DeepEqual(old.Annotations, hc.Annotations) || hc.DeletionTimestamp != nil {
				return admission.Allow()
			}
		}
		warnings, err := Validate(hc, old)
		resp := admission.Allow()
		if err != nil {
			resp = admission.Deny(http.StatusUnprocessableEntity, err.Error())
		}
		resp.Warnings = warnings
		return resp
	case admissionv1.Delete:
		hc := &hcov1beta1.HyperConverged{}
		if err := json.Unmarshal(req.OldObject.Raw, hc); err != nil {
			return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode hyperconverged: %v", err))
		}
		return w.validateDelete(ctx, hc, req.DryRun != nil && *req.DryRun)
	}
	return admission.Allow()
}

func (w *Webhook) validateDelete(ctx context.Context, hc *hcov1beta1.HyperConverged, dryRun bool) *admissionv1.AdmissionResponse {
	if w.Virt == nil {
		return admission.Deny(http.StatusInternalServerError, "hco-webhook cannot check workloads: no client")
	}
	if hc.Spec.UninstallStrategy == hcov1beta1.RemoveWorkloads {
		if !dryRun {
			if err := RemoveWorkloads(ctx, w.Virt); err != nil {
				return admission.Deny(http.StatusInternalServerError, err.Error())
			}
			w.log().Info("removed workloads before uninstall", "namespace", hc.Namespace, "name", hc.Name)
		}
		return admission.Allow()
	}
	vms, vmis, dvs, err := Workloads(ctx, w.Virt)
	if err != nil {
		return admission.Deny(http.StatusInternalServerError, err.Error())
	}
	if msg := blockingMessage(vms, vmis, dvs); msg != "" {
		return admission.Deny(http.StatusForbidden, msg)
	}
	return admission.Allow()
}

// ValidateNamespaceDeletion refuses deleting a namespace that still holds
// a HyperConverged.
func (w *Webhook) ValidateNamespaceDeletion(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	if req.Operation != admissionv1.Delete {
		return admission.Allow()
	}
	if w.Virt == nil {
		return admission.Deny(http.StatusInternalServerError, "hco-webhook cannot check the namespace: no client")
	}
	hcos, err := w.Virt.HyperConvergeds.List(ctx, req.Name, metav1.ListOptions{})
	if err != nil {
		return admission.Deny(http.StatusInternalServerError, fmt.Sprintf("list hyperconvergeds: %v", err))
	}
	if len(hcos) > 0 {
		return admission.Deny(http.StatusForbidden, nsDeletionDenied)
	}
	return admission.Allow()
}

func (w *Webhook) log() *slog.Logger {
	if w.Log == nil {
		return slog.Default()
	}
	return w.Log
}

// Validate checks a HyperConverged as upstream's webhook does (old is nil
// on create): certificate durations, TLS profile, node placement, and that
// every child renders (JSON-patch annotations included). It returns
// upstream's deprecation warnings for feature gates, and names every set
// field nodevirt does not act on (effects.go).
func Validate(hc, old *hcov1beta1.HyperConverged) ([]string, error) {
	hc = hc.DeepCopyObject().(*hcov1beta1.HyperConverged)
	SetDefaults(hc) // the API server applies upstream's CRD defaults before validation
	if err := validateCertConfig(hc.Spec.CertConfig); err != nil {
		return nil, err
	}
	if err := validateTLSProfile(hc.Spec.TLSSecurityProfile); err != nil {
		return nil, err
	}
	if err := validatePlacement("workloads", hc.Spec.Workloads.NodePlacement); err != nil {
		return nil, err
	}
	if err := validatePlacement("infra", hc.Spec.Infra.NodePlacement); err != nil {
		return nil, err
	}
	warnings := append(featureGateWarnings(hc, old), v1OnlyWarnings(hc, old)...)
	warnings = append(warnings, inertWarnings(hc, old)...)
	if _, err := Render(hc, "validate"); err != nil {
		return warnings, err
	}
	return warnings, nil
}

func validateCertConfig(cc hcov1beta1.HyperConvergedCertConfig) error {
	for _, v := range []struct {
		key string
		d   *metav1.Duration
	}{
		{"spec.certConfig.ca.duration", cc.CA.Duration}, {"spec.certConfig.ca.renewBefore", cc.CA.RenewBefore},
		{"spec.certConfig.server.duration", cc.Server.Duration}, {"spec.certConfig.server.renewBefore", cc.Server.RenewBefore},
	} {
		if v.d.Duration < minimalCertDuration {
			return fmt.Errorf("%v: value is too small", v.key)
		}
	}
	if cc.CA.Duration.Duration < cc.CA.RenewBefore.Duration {
		return errors.New("spec.certConfig.ca: duration is smaller than renewBefore")
	}
	if cc.Server.Duration.Duration < cc.Server.RenewBefore.Duration {
		return errors.New("spec.certConfig.server: duration is smaller than renewBefore")
	}
	if cc.CA.Duration.Duration < cc.Server.Duration.Duration {
		return errors.New("spec.certConfig: ca.duration is smaller than server.duration")
	}
	return nil
}

func validateTLSProfile(p *hcov1beta1.TLSSecurityProfile) error {
	if p == nil {
		return nil
	}
	if p.Custom == nil {
		if p.Type == TLSProfileCustom {
			return errors.New("missing required field spec.tlsSecurityProfile.custom when type is Custom")
		}
		return nil
	}
	v := p.Custom.MinTLSVersion
	if _, ok := tlsprofile.Versions[v]; !ok {
		return fmt.Errorf("invalid value for spec.tlsSecurityProfile.custom.minTLSVersion: %q", v)
	}
	if v != "VersionTLS13" && !slices.ContainsFunc(p.Custom.Ciphers, func(c string) bool {
		return c == "ECDHE-RSA-AES128-GCM-SHA256" || c == "ECDHE-ECDSA-AES128-GCM-SHA256"
	}) {
		return errors.New(http2CipherRequirement)
	}
	if v == "VersionTLS13" && len(p.Custom.Ciphers) > 0 {
		return errors.New("custom ciphers cannot be selected when minTLSVersion is VersionTLS13")
	}
	return nil
}

var nodeSelectorOps = map[corev1.NodeSelectorOperator]selection.Operator{
	corev1.NodeSelectorOpIn: selection.In, corev1.NodeSelectorOpNotIn: selection.NotIn,
	corev1.NodeSelectorOpExists: selection.Exists, corev1.NodeSelectorOpDoesNotExist: selection.DoesNotExist,
	corev1.NodeSelectorOpGt: selection.GreaterThan, corev1.NodeSelectorOpLt: selection.LessThan,
}

// validatePlacement checks the required node affinity as a scheduler
// would parse it, the node selector's labels and the tolerations.
func validatePlacement(group string, np *hcov1beta1.NodePlacement) error {
	if np == nil {
		return nil
	}
	var errs field.ErrorList
	if a := np.Affinity; a != nil && a.NodeAffinity != nil && a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution != nil {
		terms := field.NewPath("nodeSelectorTerms")
		for i, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
			for j, req := range term.MatchExpressions {
				p := terms.Index(i).Child("matchExpressions").Index(j)
				op, ok := nodeSelectorOps[req.Operator]
				if !ok {
					errs = append(errs, field.Invalid(p.Child("operator"), req.Operator, "not a valid selector operator"))
					continue
				}
				if _, err := k8slabels.NewRequirement(req.Key, op, req.Values); err != nil {
					errs = append(errs, field.Invalid(p, req, err.Error()))
				}
			}
			for j, req := range term.MatchFields {
				p := terms.Index(i).Child("matchFields").Index(j)
				switch {
				case req.Key != "metadata.name":
					errs = append(errs, field.Invalid(p.Child("key"), req.Key, "not a valid field selector key"))
				case req.Operator != corev1.NodeSelectorOpIn && req.Operator != corev1.NodeSelectorOpNotIn:
					errs = append(errs, field.Invalid(p.Child("operator"), req.Operator, "not a valid selector operator"))
				case len(req.Values) != 1:
					errs = append(errs, field.Required(p.Child("values"), "must have one element"))
				}
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("invalid %s node placement affinity: %v", group, errs.ToAggregate())
	}
	base := field.NewPath("spec", group, "nodePlacement")
	for k, v := range np.NodeSelector {
		for _, msg := range validation.IsQualifiedName(k) {
			errs = append(errs, field.Invalid(base.Child("nodeSelector"), k, msg))
		}
		for _, msg := range validation.IsValidLabelValue(v) {
			errs = append(errs, field.Invalid(base.Child("nodeSelector").Key(k), v, msg))
		}
	}
	for i, tol := range np.Tolerations {
		p := base.Child("tolerations").Index(i)
		switch tol.Operator {
		case "", corev1.TolerationOpEqual:
		case corev1.TolerationOpExists:
			if tol.Value != "" {
				errs = append(errs, field.Invalid(p.Child("operator"), tol.Value, "value must be empty when `operator` is 'Exists'"))
			}
		default:
			errs = append(errs, field.NotSupported(p.Child("operator"), tol.Operator, []string{string(corev1.TolerationOpEqual), string(corev1.TolerationOpExists)}))
		}
		switch tol.Effect {
		case "", corev1.TaintEffectNoSchedule, corev1.TaintEffectPreferNoSchedule, corev1.TaintEffectNoExecute:
		default:
			errs = append(errs, field.NotSupported(p.Child("effect"), tol.Effect, []string{string(corev1.TaintEffectNoSchedule),
				string(corev1.TaintEffectPreferNoSchedule), string(corev1.TaintEffectNoExecute)}))
		}
	}
	if len(errs) > 0 {
		return errs.ToAggregate()
	}
	return nil
}

// featureGateWarnings are upstream's v1beta1 deprecation warnings; the
// gates moved to spec fields warn only when set on create or changed.
func featureGateWarnings(hc, old *hcov1beta1.HyperConverged) []string {
	fg := hc.Spec.FeatureGates
	var w []string
	for _, d := range []struct {
		name string
		v    *bool
	}{
		{"withHostPassthroughCPU", fg.WithHostPassthroughCPU}, {"deployTektonTaskResources", fg.DeployTektonTaskResources},
		{"nonRoot", fg.NonRoot}, {"enableManagedTenantQuota", fg.EnableManagedTenantQuota},
	} {
		if d.v != nil {
			w = append(w, fmt.Sprintf(fgDeprecationWarning, d.name))
		}
	}
	if fg.DisableMDevConfiguration != nil {
		w = append(w, "spec.featureGates.disableMDevConfiguration is deprecated. Use spec.virtualization.mediatedDevicesConfiguration.enabled in the v1 API instead; it will be removed in a future version.")
	}
	if fg.PersistentReservation != nil {
		w = append(w, "spec.featureGates.persistentReservation is deprecated. Use spec.storage.persistentReservationConfiguration.enabled in the v1 API instead; it will be removed in a future version.")
	}
	if fg.EnableMultiArchBootImageImport != nil && *fg.EnableMultiArchBootImageImport {
		w = append(w, "spec.featureGates.enableMultiArchBootImageImport is deprecated. Use spec.workloadSources.enableMultiArchBootImageImport in the v1 API instead; it will be removed in a future version.")
	}
	var ofg hcov1beta1.HyperConvergedFeatureGates
	if old != nil {
		ofg = old.Spec.FeatureGates
	}
	for _, m := range []struct {
		name   string
		v, old *bool
	}{
		{"enableApplicationAwareQuota", fg.EnableApplicationAwareQuota, ofg.EnableApplicationAwareQuota},
		{"enableCommonBootImageImport", fg.EnableCommonBootImageImport, ofg.EnableCommonBootImageImport},
		{"deployVmConsoleProxy", fg.DeployVMConsoleProxy, ofg.DeployVMConsoleProxy},
	} {
		if m.v != nil && (old == nil || m.old == nil || *m.old != *m.v) {
			w = append(w, fmt.Sprintf(fgMovedWarning, m.name))
		}
	}
	return w
}

// Webhooks returns the admission.Contributor that serves the hco-webhook on
// the brain's server, registered for HyperConverged CRs and for deleting
// namespace (the HyperConverged's own).
func Webhooks(namespace string) admission.Contributor {
	return func(s *admission.Server) error { return register(s, namespace) }
}

func register(s *admission.Server, namespace string) error {
	d := s.Deps()
	w := &Webhook{Virt: d.Virt, Log: d.Log.With("role", "hco-webhook")}
	all := []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update, admissionregistrationv1.Delete}
	s.Register(admission.Webhook{
		Name: "validate-hco.kubevirt.io", Path: ValidatePath, SideEffects: true, Timeout: 30 * time.Second,
		Rules: []admissionregistrationv1.RuleWithOperations{{Operations: all, Rule: admissionregistrationv1.Rule{
			APIGroups: []string{hcov1beta1.SchemeGroupVersion.Group}, APIVersions: []string{hcov1beta1.SchemeGroupVersion.Version},
			Resources: []string{"hyperconvergeds"}}}},
		Admit: w.ValidateHyperConverged,
	})
	s.Register(admission.Webhook{
		Name: "validate-ns-hco.kubevirt.io", Path: NamespacePath,
		NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{corev1.LabelMetadataName: namespace}},
		Rules: []admissionregistrationv1.RuleWithOperations{{
			Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Delete},
			Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"namespaces"}}}},
		Admit: w.ValidateNamespaceDeletion,
	})
	return nil
}

// v1OnlyWarnings names the hco.kubevirt.io/v1 fields with no v1beta1
// counterpart that a HyperConverged sets (kept by the conversion in its
// hco.kubevirt.io/v1-only-fields annotation): nodevirt does not act on
// them, and says so instead of ignoring them silently. Unchanged ones are
// not warned about again.
func v1OnlyWarnings(hc, old *hcov1beta1.HyperConverged) []string {
	fields := func(h *hcov1beta1.HyperConverged) []string {
		if h == nil {
			return nil
		}
		var m map[string]any
		if json.Unmarshal([]byte(h.Annotations[hcoconvert.V1OnlyAnnotation]), &m) != nil {
			return nil
		}
		return leafPaths("spec", m)
	}
	before := map[string]bool{}
	for _, f := range fields(old) {
		before[f] = true
	}
	var out []string
	for _, f := range fields(hc) {
		if !before[f] {
			out = append(out, fmt.Sprintf("%s (hco.kubevirt.io/v1) has no effect in nodevirt", f))
		}
	}
	return out
}

func leafPaths(prefix string, m map[string]any) []string {
	var out []string
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if sub, ok := m[k].(map[string]any); ok && len(sub) > 0 {
			out = append(out, leafPaths(prefix+"."+k, sub)...)
			continue
		}
		out = append(out, prefix+"."+k)
	}
	return out
}
