package datavolume

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
)

// AnnAuthorizedSource records, on a DataVolume that clones a claim or
// restores a snapshot, the source its creator was authorized for when it
// was admitted: "pvc/<namespace>/<name>" or "snapshot/<namespace>/<name>".
// Only the DataVolume webhook writes it (it drops what a user sets at
// creation and refuses any change later), and the controller clones only
// from the source it names, so a DataSource retargeted after admission
// does not widen what the DataVolume reads.
const AnnAuthorizedSource = "nodevirt.io/authorized-clone-source"

// Webhook paths on the brain's admission server.
const (
	DataVolumePath     = "/mutate-cdi-kubevirt-io-datavolume-clone-source"
	VMTemplatesPath    = "/validate-kubevirt-io-vm-datavolumetemplate-clone-source"
	authorizeTimeout   = 15 * time.Second
	kindPVCSource      = "pvc"
	kindSnapshotSource = "snapshot"
)

// authorizer decides whether a user may clone a DataVolume's source with
// CDI's own rule (DataVolume.AuthorizeUser): from another namespace, the
// user needs "create" on datavolumes/source (cdi.kubevirt.io) in the source
// namespace — or, for a claim, "create" on pods there; for a snapshot,
// "create" on both pods and pvcs.
type authorizer struct {
	kube kubernetes.Interface
	virt *client.Set
}

// cdiProxy is the AuthorizationHelperProxy CDI's check calls.
type cdiProxy struct {
	ctx context.Context
	a   *authorizer
}

func (p cdiProxy) CreateSar(sar *authzv1.SubjectAccessReview) (*authzv1.SubjectAccessReview, error) {
	return p.a.kube.AuthorizationV1().SubjectAccessReviews().Create(p.ctx, sar, metav1.CreateOptions{})
}

func (p cdiProxy) GetNamespace(name string) (*corev1.Namespace, error) {
	return p.a.kube.CoreV1().Namespaces().Get(p.ctx, name, metav1.GetOptions{})
}

func (p cdiProxy) GetDataSource(ns, name string) (*cdiv1.DataSource, error) {
	return p.a.virt.DataSources.Get(p.ctx, ns, name)
}

// authorize returns the source dv clones ("" for no clone) when user may
// clone it, or the reason it may not.
func (a *authorizer) authorize(ctx context.Context, dv *cdiv1.DataVolume, user authnv1.UserInfo) (source string, denied string, err error) {
	resp, err := dv.AuthorizeUser(dv.Namespace, dv.Name, cdiProxy{ctx: ctx, a: a}, user)
	if errors.Is(err, cdiv1.ErrNoTokenOkay) {
		return "", "", nil
	}
	if apierrors.IsNotFound(err) {
		// A DataSource (or source namespace) that does not exist yet: the
		// DataVolume is admitted unstamped and waits; the controller then
		// clones only from its own namespace (checkAuthorized).
		return "", "", nil
	}
	if err != nil {
		return "", "", fmt.Errorf("authorize clone source of datavolume %s/%s: %w", dv.Namespace, dv.Name, err)
	}
	if !resp.Allowed {
		return "", resp.Reason, nil
	}
	ns := resp.Handler.SourceNamespace
	if ns == "" {
		ns = dv.Namespace
	}
	kind := kindPVCSource
	if resp.Handler.TokenResource.Resource == "volumesnapshots" {
		kind = kindSnapshotSource
	}
	return kind + "/" + ns + "/" + resp.Handler.SourceName, "", nil
}

// Webhooks returns the admission.Contributor that registers the clone
// authorization webhooks: DataVolumes (creation is authorized and stamped
// with AnnAuthorizedSource; the source and the stamp cannot change later)
// and VirtualMachines (each dataVolumeTemplate is authorized for the
// requesting user, as KubeVirt's VM admitter does, since the brain — not
// the user — creates those DataVolumes).
func Webhooks() admission.Contributor {
	return func(s *admission.Server) error {
		d := s.Deps()
		if d.Virt == nil {
			return errors.New("datavolume webhooks: virt client is required")
		}
		a := &authorizer{kube: d.Kube, virt: d.Virt}
		cu := []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update}
		s.Register(admission.Webhook{
			Name: "datavolume-clone-source.nodevirt.io", Path: DataVolumePath, Mutating: true, Timeout: authorizeTimeout,
			Rules: []admissionregistrationv1.RuleWithOperations{{Operations: cu, Rule: admissionregistrationv1.Rule{
				APIGroups: []string{cdiv1.SchemeGroupVersion.Group}, APIVersions: []string{"*"}, Resources: []string{"datavolumes"}}}},
			Admit: a.admitDataVolume,
		})
		s.Register(admission.Webhook{
			Name: "vm-datavolumetemplate-clone-source.nodevirt.io", Path: VMTemplatesPath, Timeout: authorizeTimeout,
			Rules: []admissionregistrationv1.RuleWithOperations{{Operations: cu, Rule: admissionregistrationv1.Rule{
				APIGroups: []string{kubevirtv1.SchemeGroupVersion.Group}, APIVersions: []string{"*"}, Resources: []string{"virtualmachines"}}}},
			Admit: a.admitVM,
		})
		return nil
	}
}

// admitDataVolume authorizes a new DataVolume's clone source and stamps
// it; on update it refuses a changed source or stamp.
func (a *authorizer) admitDataVolume(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var dv cdiv1.DataVolume
	if err := json.Unmarshal(req.Object.Raw, &dv); err != nil {
		return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode datavolume: %v", err))
	}
	if dv.Namespace == "" {
		dv.Namespace = req.Namespace
	}
	if dv.Name == "" {
		dv.Name = req.Name
	}
	if req.Operation == admissionv1.Update {
		var old cdiv1.DataVolume
		if err := json.Unmarshal(req.OldObject.Raw, &old); err != nil {
			return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode old datavolume: %v", err))
		}
		if old.Annotations[AnnAuthorizedSource] != dv.Annotations[AnnAuthorizedSource] {
			return admission.Denyf("metadata.annotations[%s] cannot be changed: it is the clone source the creator was authorized for", AnnAuthorizedSource)
		}
		if !reflect.DeepEqual(old.Spec.Source, dv.Spec.Source) || !reflect.DeepEqual(old.Spec.SourceRef, dv.Spec.SourceRef) {
			return admission.Denyf("spec.source and spec.sourceRef of datavolume %s/%s cannot be changed", dv.Namespace, dv.Name)
		}
		return admission.Allow()
	}
	source, denied, err := a.authorize(ctx, &dv, req.UserInfo)
	if err != nil {
		return admission.Deny(http.StatusInternalServerError, err.Error())
	}
	if denied != "" {
		return admission.Deny(http.StatusForbidden, denied)
	}
	return admission.Patch(stampOps(dv.Annotations, source))
}

// stampOps are the JSON patch operations that set AnnAuthorizedSource to
// source (or remove a value the user set, when source is "").
func stampOps(ann map[string]string, source string) []admission.PatchOp {
	path := "/metadata/annotations/" + strings.ReplaceAll(strings.ReplaceAll(AnnAuthorizedSource, "~", "~0"), "/", "~1")
	_, had := ann[AnnAuthorizedSource]
	switch {
	case source == "" && had:
		return []admission.PatchOp{{Op: "remove", Path: path}}
	case source == "":
		return nil
	case ann == nil:
		return []admission.PatchOp{{Op: "add", Path: "/metadata/annotations", Value: map[string]string{AnnAuthorizedSource: source}}}
	case had:
		return []admission.PatchOp{{Op: "replace", Path: path, Value: source}}
	default:
		return []admission.PatchOp{{Op: "add", Path: path, Value: source}}
	}
}

// admitVM authorizes the clone source of every dataVolumeTemplate of a VM
// for the user who writes it.
func (a *authorizer) admitVM(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vm kubevirtv1.VirtualMachine
	if err := json.Unmarshal(req.Object.Raw, &vm); err != nil {
		return admission.Deny(http.StatusBadRequest, fmt.Sprintf("decode virtualmachine: %v", err))
	}
	ns := vm.Namespace
	if ns == "" {
		ns = req.Namespace
	}
	if req.Operation == admissionv1.Update {
		var old kubevirtv1.VirtualMachine
		if err := json.Unmarshal(req.OldObject.Raw, &old); err == nil && reflect.DeepEqual(old.Spec.DataVolumeTemplates, vm.Spec.DataVolumeTemplates) {
			return admission.Allow() // authorized when they were written
		}
	}
	for i, t := range vm.Spec.DataVolumeTemplates {
		dv := &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: t.Name, Annotations: t.Annotations}, Spec: t.Spec}
		_, denied, err := a.authorize(ctx, dv, req.UserInfo)
		if err != nil {
			return admission.Deny(http.StatusInternalServerError, err.Error())
		}
		if denied != "" {
			return admission.Deny(http.StatusForbidden, fmt.Sprintf("spec.dataVolumeTemplates[%d]: %s", i, denied))
		}
	}
	return admission.Allow()
}
