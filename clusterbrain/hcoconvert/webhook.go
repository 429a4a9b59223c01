package hcoconvert

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// Path is where the brain's webhook server answers ConversionReviews.
const Path = "/convert-hyperconverged"

// Handler answers apiextensions.k8s.io/v1 ConversionReviews for
// HyperConverged objects.
func Handler(log *slog.Logger) http.Handler {
	return httperr.TextHandler(func(w http.ResponseWriter, r *http.Request) error {
		body, err := io.ReadAll(io.LimitReader(r.Body, 16<<20))
		if err != nil {
			return httperr.BadRequest("read body")
		}
		var review apiextensionsv1.ConversionReview
		if err := json.Unmarshal(body, &review); err != nil || review.Request == nil {
			return httperr.BadRequest("not a conversion review")
		}
		resp := review.Request.UID
		out := apiextensionsv1.ConversionReview{TypeMeta: review.TypeMeta,
			Response: &apiextensionsv1.ConversionResponse{UID: resp}}
		objs, err := convertAll(review.Request.Objects, review.Request.DesiredAPIVersion)
		if err != nil {
			log.Warn("hyperconverged conversion refused", "to", review.Request.DesiredAPIVersion, "err", err)
			out.Response.Result = metav1.Status{Status: metav1.StatusFailure, Message: err.Error()}
		} else {
			out.Response.ConvertedObjects = objs
			out.Response.Result = metav1.Status{Status: metav1.StatusSuccess}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(&out)
		return nil
	})
}

func convertAll(in []runtime.RawExtension, to string) ([]runtime.RawExtension, error) {
	out := make([]runtime.RawExtension, 0, len(in))
	for _, raw := range in {
		var obj Object
		if err := json.Unmarshal(raw.Raw, &obj); err != nil {
			return nil, fmt.Errorf("decode object: %w", err)
		}
		conv, err := Convert(obj, to)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name(obj), err)
		}
		data, err := json.Marshal(conv)
		if err != nil {
			return nil, fmt.Errorf("encode %s: %w", name(obj), err)
		}
		out = append(out, runtime.RawExtension{Raw: data})
	}
	return out, nil
}

func name(obj Object) string {
	md, _ := obj["metadata"].(map[string]any)
	return fmt.Sprintf("%v/%v", md["namespace"], md["name"])
}

// Register returns the admission.Contributor that serves the conversion on
// the brain's webhook server and points the HyperConverged CRD's
// conversion webhook at it (with the server's CA bundle) each time the
// server publishes its webhooks.
func Register(cfg *rest.Config) admission.Contributor {
	return func(s *admission.Server) error {
		ext, err := apiextensionsclient.NewForConfig(cfg)
		if err != nil {
			return fmt.Errorf("hco conversion: %w", err)
		}
		log := s.Deps().Log.With("role", "hco-conversion")
		s.HandleHTTP(Path, Handler(log))
		s.OnPublish(func(ctx context.Context, t admission.Target, bundle []byte) error {
			return PointCRD(ctx, ext, t.ClientConfig(Path, bundle))
		})
		return nil
	}
}

// CRDName is the HyperConverged CRD.
const CRDName = "hyperconvergeds.hco.kubevirt.io"

// FieldManager owns the CRD's conversion settings (and nothing else of it).
const FieldManager = "nodevirt-hco-conversion"

// PointCRD sets the HyperConverged CRD's conversion to the webhook cc
// names (a URL or a Service), trusted through its CA bundle.
func PointCRD(ctx context.Context, ext apiextensionsclient.Interface, cc admissionregistrationv1.WebhookClientConfig) error {
	client := map[string]any{"caBundle": cc.CABundle}
	where := ""
	if cc.Service != nil {
		client["service"] = map[string]any{"namespace": cc.Service.Namespace, "name": cc.Service.Name, "path": cc.Service.Path, "port": cc.Service.Port}
		where = "service " + cc.Service.Namespace + "/" + cc.Service.Name
	} else if cc.URL != nil {
		client["url"] = *cc.URL
		where = *cc.URL
	}
	patch := map[string]any{
		"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
		"metadata": map[string]any{"name": CRDName},
		"spec": map[string]any{"conversion": map[string]any{
			"strategy": "Webhook",
			"webhook": map[string]any{
				"conversionReviewVersions": []string{"v1"},
				"clientConfig":             client,
			},
		}},
	}
	data, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	force := true
	if _, err := ext.ApiextensionsV1().CustomResourceDefinitions().Patch(ctx, CRDName, types.ApplyPatchType, data,
		metav1.PatchOptions{FieldManager: FieldManager, Force: &force}); err != nil {
		return fmt.Errorf("point %s conversion at %s: %w", CRDName, where, err)
	}
	return nil
}
