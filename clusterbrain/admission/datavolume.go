package admission

import (
	"context"
	"encoding/json"
	"net/url"
	"strings"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

// DataVolumeValidatorName is CDI's name of its DataVolume webhook.
const DataVolumeValidatorName = "datavolume-validate.cdi.kubevirt.io"

// RegisterDataVolumes adds CDI's DataVolume create validation to s.
func RegisterDataVolumes(s *Server) error {
	s.Register(Webhook{Name: DataVolumeValidatorName, Path: "/datavolumes-validate",
		Rules: []admissionregistrationv1.RuleWithOperations{{
			Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
			Rule: admissionregistrationv1.Rule{APIGroups: []string{cdiv1.SchemeGroupVersion.Group},
				APIVersions: []string{cdiv1.SchemeGroupVersion.Version}, Resources: []string{"datavolumes"}},
		}},
		Admit: admitDataVolume})
	return nil
}

func admitDataVolume(_ context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var dv cdiv1.DataVolume
	if err := json.Unmarshal(req.Object.Raw, &dv); err != nil {
		return Denyf("decode datavolume: %v", err)
	}
	if errs := ValidateDataVolumeSpec(field.NewPath("spec"), &dv.Spec); len(errs) > 0 {
		return DenyFields(errs)
	}
	return Allow()
}

// ValidateDataVolumeSpec checks the structure of a DataVolume spec at p as
// CDI's webhook does: one source (or a sourceRef), each source's own
// fields, and a claim spec (pvc or storage, not both; none only for a
// clone, a snapshot restore or a sourceRef) that asks for a size where the
// size cannot come from the source or the storage profile. Sources nodevirt does not
// import (S3, GCS, imageio, VDDK) are left to the DataVolume controller,
// which fails them with a reason.
func ValidateDataVolumeSpec(p *field.Path, spec *cdiv1.DataVolumeSpec) field.ErrorList {
	var errs field.ErrorList
	src := spec.Source
	switch {
	case src == nil && spec.SourceRef == nil:
		errs = append(errs, field.Required(p.Child("source"), "missing data volume source"))
	case src != nil && spec.SourceRef != nil:
		errs = append(errs, field.Forbidden(p.Child("sourceRef"), "source and sourceRef cannot be used together"))
	}
	if ref := spec.SourceRef; ref != nil {
		rp := p.Child("sourceRef")
		if ref.Kind != cdiv1.DataVolumeDataSource {
			errs = append(errs, field.NotSupported(rp.Child("kind"), ref.Kind, []string{cdiv1.DataVolumeDataSource}))
		}
		if ref.Name == "" {
			errs = append(errs, field.Required(rp.Child("name"), "sourceRef needs a name"))
		}
	}
	sizeFromSource := spec.SourceRef != nil
	if src != nil {
		sp := p.Child("source")
		n := 0
		for _, set := range []bool{src.HTTP != nil, src.S3 != nil, src.GCS != nil, src.Registry != nil, src.PVC != nil,
			src.Upload != nil, src.Blank != nil, src.Imageio != nil, src.VDDK != nil, src.Snapshot != nil} {
			if set {
				n++
			}
		}
		if n != 1 {
			errs = append(errs, field.Invalid(sp, n, "exactly one data volume source must be set"))
		}
		if h := src.HTTP; h != nil {
			errs = append(errs, validateURL(sp.Child("http", "url"), h.URL, "http", "https")...)
		}
		if r := src.Registry; r != nil {
			rp := sp.Child("registry")
			switch {
			case (r.URL == nil) == (r.ImageStream == nil):
				errs = append(errs, field.Invalid(rp, "", "exactly one of url and imageStream must be set"))
			case r.URL != nil:
				errs = append(errs, validateURL(rp.Child("url"), *r.URL, "docker", "oci-archive")...)
			case *r.ImageStream == "":
				errs = append(errs, field.Required(rp.Child("imageStream"), "imageStream must not be empty"))
			}
			if m := r.PullMethod; m != nil && *m != cdiv1.RegistryPullPod && *m != cdiv1.RegistryPullNode {
				errs = append(errs, field.NotSupported(rp.Child("pullMethod"), *m, []string{string(cdiv1.RegistryPullPod), string(cdiv1.RegistryPullNode)}))
			}
		}
		if c := src.PVC; c != nil {
			sizeFromSource = true
			if c.Name == "" {
				errs = append(errs, field.Required(sp.Child("pvc", "name"), "source pvc needs a name"))
			}
		}
		if s := src.Snapshot; s != nil {
			sizeFromSource = true
			if s.Name == "" {
				errs = append(errs, field.Required(sp.Child("snapshot", "name"), "source snapshot needs a name"))
			}
		}
	}
	switch spec.ContentType {
	case "", cdiv1.DataVolumeKubeVirt, cdiv1.DataVolumeArchive:
	default:
		errs = append(errs, field.NotSupported(p.Child("contentType"), spec.ContentType,
			[]string{string(cdiv1.DataVolumeKubeVirt), string(cdiv1.DataVolumeArchive)}))
	}
	switch {
	case spec.PVC == nil && spec.Storage == nil:
		// "storage:" left empty, as CDI's own clone example does, is a
		// claim spec entirely from defaults and the source.
		if !sizeFromSource {
			errs = append(errs, field.Required(p.Child("storage"), "missing data volume pvc or storage"))
		}
	case spec.PVC != nil && spec.Storage != nil:
		errs = append(errs, field.Forbidden(p.Child("storage"), "pvc and storage cannot be used together"))
	case spec.PVC != nil:
		pp := p.Child("pvc")
		if len(spec.PVC.AccessModes) == 0 {
			errs = append(errs, field.Required(pp.Child("accessModes"), "pvc needs at least one access mode"))
		}
		errs = append(errs, validateSize(pp.Child("resources", "requests", "storage"), spec.PVC.Resources.Requests, sizeFromSource)...)
	default:
		errs = append(errs, validateSize(p.Child("storage", "resources", "requests", "storage"), spec.Storage.Resources.Requests, true)...)
	}
	return errs
}

func validateURL(p *field.Path, raw string, schemes ...string) field.ErrorList {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" && u.Opaque == "" && u.Path == "" {
		return field.ErrorList{field.Invalid(p, raw, "not a valid url")}
	}
	for _, s := range schemes {
		if strings.EqualFold(u.Scheme, s) {
			return nil
		}
	}
	return field.ErrorList{field.NotSupported(p.Child("scheme"), u.Scheme, schemes)}
}

// validateSize checks a requested storage size; optional says it may be
// left out (taken from the source, or from the storage profile).
func validateSize(p *field.Path, requests corev1.ResourceList, optional bool) field.ErrorList {
	q, ok := requests[corev1.ResourceStorage]
	switch {
	case !ok && !optional:
		return field.ErrorList{field.Required(p, "the requested size is missing")}
	case ok && q.Sign() <= 0:
		return field.ErrorList{field.Invalid(p, q.String(), "must be greater than zero")}
	}
	return nil
}
