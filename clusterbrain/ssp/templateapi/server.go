// Package templateapi serves template.openshift.io/v1 as an aggregated API
// of the brain: templates (kept as nodevirt.io StoredTemplates, converted
// on the way in and out, watch included) and processedtemplates, which
// returns a posted Template with its parameters resolved and substituted
// as OpenShift's template processor does — so `oc process` and
// `kubectl create --raw …/processedtemplates` work unchanged.
package templateapi

import (
	"context"
	"encoding/json"
	"errors"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	authv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
)

// ServiceName fronts the API in the brain's namespace.
const ServiceName = "nodevirt-templates"

var (
	storage = schema.GroupVersionResource{Group: templates.StorageGroup, Version: templates.StorageVersion, Resource: templates.StorageResource}
	gv      = templates.Group + "/" + templates.APIVersion
)

// Config configures the server.
type Config struct {
	Kube    kubernetes.Interface
	Dynamic dynamic.Interface
	// Namespace holds the Service and certificates.
	Namespace string
	// Addr is the listen address (default ":8448").
	Addr string
	// TLSProfile is the KubeVirt CR's TLS settings for the server (nil:
	// TLS 1.2 and Go's suites).
	TLSProfile *tlsprofile.Live
	Log        *slog.Logger
}

// Server is the template.openshift.io aggregated API.
type Server struct {
	cfg Config
	agg *aggregated.Server
}

// New defaults and validates cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Kube == nil || cfg.Dynamic == nil || cfg.Namespace == "" {
		return nil, errors.New("templateapi: kube and dynamic clients and a namespace are required")
	}
	if cfg.Addr == "" {
		cfg.Addr = ":8448"
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	s := &Server{cfg: cfg}
	agg, err := aggregated.NewServer(aggregated.Config{Kube: cfg.Kube, Dynamic: cfg.Dynamic, Addr: cfg.Addr, Handler: s, TLSProfile: cfg.TLSProfile,
		Log: cfg.Log.With("role", "template-api"),
		Registration: aggregated.Registration{Group: templates.Group, Versions: []string{templates.APIVersion},
			Namespace: cfg.Namespace, Service: ServiceName, GroupPriorityMinimum: 1000, VersionPriority: 15}})
	if err != nil {
		return nil, err
	}
	s.agg = agg
	return s, nil
}

// Name names the brain role.
func (s *Server) Name() string { return "template-api" }

// Ready is closed once the API is registered and served.
func (s *Server) Ready() <-chan struct{} { return s.agg.Ready() }

// Run serves until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	return s.agg.Run(ctx)
}

// request is a parsed resource path.
type request struct {
	namespace, resource, name string
}

// parse splits /apis/template.openshift.io/v1[/namespaces/{ns}]/{resource}[/{name}].
func parse(path string) (request, bool) {
	parts := strings.Split(strings.Trim(path, "/"), "/")
	if len(parts) < 4 || parts[0] != "apis" || parts[1] != templates.Group || parts[2] != templates.APIVersion {
		return request{}, false
	}
	parts = parts[3:]
	var r request
	if parts[0] == "namespaces" {
		if len(parts) < 3 {
			return request{}, false
		}
		r.namespace, parts = parts[1], parts[2:]
	}
	r.resource = parts[0]
	switch len(parts) {
	case 1:
	case 2:
		r.name = parts[1]
	default:
		return request{}, false
	}
	return r, true
}

// ServeHTTP routes discovery and resource requests.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.serveDiscovery(w, r) {
		return
	}
	req, ok := parse(r.URL.Path)
	if !ok {
		httperr.WriteStatus(w, apierrors.NewNotFound(schema.GroupResource{Group: templates.Group}, r.URL.Path))
		return
	}
	verb := verbOf(r, req)
	switch {
	case req.resource == "processedtemplates" && verb == "create" && req.name == "":
	case req.resource == "templates" && verb != "":
	default:
		httperr.WriteStatus(w, apierrors.NewMethodNotSupported(schema.GroupResource{Group: templates.Group, Resource: req.resource}, r.Method))
		return
	}
	u, _ := aggregated.UserFrom(r.Context())
	attrs := authv1.ResourceAttributes{Namespace: req.namespace, Verb: verb, Group: templates.Group, Version: templates.APIVersion,
		Resource: req.resource, Name: req.name}
	allowed, reason, err := aggregated.Authorize(r.Context(), s.cfg.Kube, u, attrs)
	if err != nil {
		httperr.WriteStatus(w, err)
		return
	}
	if !allowed {
		httperr.WriteStatus(w, aggregated.Forbidden(u, attrs, reason))
		return
	}
	if req.resource == "processedtemplates" {
		s.process(w, r, req)
		return
	}
	s.templates(w, r, req, verb)
}

// verbOf returns the RBAC verb of r ("" for a method the resource lacks).
func verbOf(r *http.Request, req request) string {
	q := r.URL.Query()
	switch r.Method {
	case http.MethodGet:
		switch {
		case req.name != "":
			return "get"
		case q.Get("watch") == "true" || q.Get("watch") == "1":
			return "watch"
		}
		return "list"
	case http.MethodPost:
		if req.name == "" {
			return "create"
		}
	case http.MethodPut:
		if req.name != "" {
			return "update"
		}
	case http.MethodPatch:
		if req.name != "" {
			return "patch"
		}
	case http.MethodDelete:
		if req.name == "" {
			return "deletecollection"
		}
		return "delete"
	}
	return ""
}

// process answers POST processedtemplates.
func (s *Server) process(w http.ResponseWriter, r *http.Request, req request) {
	body, err := readObject(r)
	if err != nil {
		httperr.WriteStatus(w, err)
		return
	}
	out, err := templates.Process(body, nil)
	if err != nil {
		httperr.WriteStatus(w, apierrors.NewInvalid(schema.GroupKind{Group: templates.Group, Kind: "Template"}, nameOf(body),
			field.ErrorList{field.Invalid(field.NewPath("parameters"), nil, err.Error())}))
		return
	}
	out["apiVersion"], out["kind"] = gv, "Template"
	s.cfg.Log.Debug("processed template", "namespace", req.namespace, "name", nameOf(body))
	httperr.WriteJSON(w, http.StatusCreated, out)
}

func readObject(r *http.Request) (map[string]any, error) {
	data, err := io.ReadAll(io.LimitReader(r.Body, 8<<20))
	if err != nil {
		return nil, apierrors.NewBadRequest("read body: " + err.Error())
	}
	var obj map[string]any
	if err := json.Unmarshal(data, &obj); err != nil {
		return nil, apierrors.NewBadRequest("body is not a JSON object: " + err.Error())
	}
	return obj, nil
}

func nameOf(obj map[string]any) string {
	md, _ := obj["metadata"].(map[string]any)
	n, _ := md["name"].(string)
	return n
}

// toStored and fromStored switch an object between the served and the
// stored group version.
func toStored(obj map[string]any) {
	obj["apiVersion"], obj["kind"] = templates.StorageGroup+"/"+templates.StorageVersion, templates.StorageKind
}

func fromStored(obj map[string]any) map[string]any {
	obj["apiVersion"], obj["kind"] = gv, "Template"
	return obj
}

// templates serves the templates resource from the stored ones.
func (s *Server) templates(w http.ResponseWriter, r *http.Request, req request, verb string) {
	ctx := r.Context()
	res := s.cfg.Dynamic.Resource(storage).Namespace(req.namespace)
	q := r.URL.Query()
	var out any
	var err error
	code := http.StatusOK
	switch verb {
	case "get":
		var got *unstructured.Unstructured
		if got, err = res.Get(ctx, req.name, metav1.GetOptions{ResourceVersion: q.Get("resourceVersion")}); err == nil {
			out = s.shape(r, fromStored(got.Object))
		}
	case "list":
		var list *unstructured.UnstructuredList
		if list, err = res.List(ctx, listOptions(q)); err == nil {
			items := make([]any, 0, len(list.Items))
			for _, it := range list.Items {
				items = append(items, s.shape(r, fromStored(it.Object)))
			}
			md, _ := list.Object["metadata"].(map[string]any)
			kind, apiVersion := "TemplateList", gv
			if metadataOnly(r) {
				kind, apiVersion = "PartialObjectMetadataList", metaGV
			}
			out = map[string]any{"apiVersion": apiVersion, "kind": kind, "metadata": md, "items": items}
		}
	case "watch":
		s.watch(w, r, res, listOptions(q))
		return
	case "create", "update":
		var body map[string]any
		if body, err = readObject(r); err != nil {
			break
		}
		toStored(body)
		var got *unstructured.Unstructured
		if verb == "create" {
			code = http.StatusCreated
			got, err = res.Create(ctx, &unstructured.Unstructured{Object: body}, metav1.CreateOptions{DryRun: q["dryRun"], FieldManager: q.Get("fieldManager")})
		} else {
			got, err = res.Update(ctx, &unstructured.Unstructured{Object: body}, metav1.UpdateOptions{DryRun: q["dryRun"], FieldManager: q.Get("fieldManager")})
		}
		if err == nil {
			out = fromStored(got.Object)
		}
	case "patch":
		var data []byte
		if data, err = io.ReadAll(io.LimitReader(r.Body, 8<<20)); err != nil {
			break
		}
		pt := types.PatchType(strings.Split(r.Header.Get("Content-Type"), ";")[0])
		if pt == types.ApplyPatchType || pt == types.ApplyYAMLPatchType {
			var obj map[string]any
			if err = json.Unmarshal(data, &obj); err != nil {
				err = apierrors.NewBadRequest("apply patch must be JSON: " + err.Error())
				break
			}
			toStored(obj)
			data, _ = json.Marshal(obj)
			pt = types.ApplyPatchType
		}
		if pt == types.StrategicMergePatchType {
			pt = types.MergePatchType
		}
		opts := metav1.PatchOptions{DryRun: q["dryRun"], FieldManager: q.Get("fieldManager")}
		if f, perr := strconv.ParseBool(q.Get("force")); perr == nil {
			opts.Force = &f
		}
		var got *unstructured.Unstructured
		if got, err = res.Patch(ctx, req.name, pt, data, opts); err == nil {
			out = fromStored(got.Object)
		}
	case "delete":
		if err = res.Delete(ctx, req.name, metav1.DeleteOptions{DryRun: q["dryRun"]}); err == nil {
			out = metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}, Status: metav1.StatusSuccess,
				Details: &metav1.StatusDetails{Name: req.name, Group: templates.Group, Kind: "templates"}}
		}
	case "deletecollection":
		if err = res.DeleteCollection(ctx, metav1.DeleteOptions{DryRun: q["dryRun"]}, listOptions(q)); err == nil {
			out = metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}, Status: metav1.StatusSuccess}
		}
	}
	if err != nil {
		httperr.WriteStatus(w, served(err))
		return
	}
	httperr.WriteJSON(w, code, out)
}

// served renames the stored resource in API errors.
func served(err error) error {
	var se apierrors.APIStatus
	if !errors.As(err, &se) {
		return err
	}
	st := se.Status()
	st.Message = strings.ReplaceAll(st.Message, templates.StorageResource+"."+templates.StorageGroup, "templates."+templates.Group)
	if st.Details != nil && st.Details.Group == templates.StorageGroup {
		st.Details.Group, st.Details.Kind = templates.Group, "templates"
	}
	return &apierrors.StatusError{ErrStatus: st}
}

func listOptions(q map[string][]string) metav1.ListOptions {
	get := func(k string) string {
		if v := q[k]; len(v) > 0 {
			return v[0]
		}
		return ""
	}
	o := metav1.ListOptions{LabelSelector: get("labelSelector"), FieldSelector: get("fieldSelector"),
		ResourceVersion: get("resourceVersion"), Continue: get("continue"), AllowWatchBookmarks: get("allowWatchBookmarks") == "true"}
	if n, err := strconv.ParseInt(get("limit"), 10, 64); err == nil {
		o.Limit = n
	}
	if n, err := strconv.ParseInt(get("timeoutSeconds"), 10, 64); err == nil {
		o.TimeoutSeconds = &n
	}
	return o
}

// watch streams the stored templates' events as Templates.
func (s *Server) watch(w http.ResponseWriter, r *http.Request, res dynamic.ResourceInterface, opts metav1.ListOptions) {
	wi, err := res.Watch(r.Context(), opts)
	if err != nil {
		httperr.WriteStatus(w, served(err))
		return
	}
	defer wi.Stop()
	flusher, _ := w.(http.Flusher)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Transfer-Encoding", "chunked")
	w.WriteHeader(http.StatusOK)
	if flusher != nil {
		flusher.Flush()
	}
	enc := json.NewEncoder(w)
	for {
		select {
		case <-r.Context().Done():
			return
		case ev, ok := <-wi.ResultChan():
			if !ok {
				return
			}
			var obj any = ev.Object
			if u, isU := ev.Object.(*unstructured.Unstructured); isU {
				if u.GetKind() == templates.StorageKind {
					obj = s.shape(r, fromStored(u.Object))
				} else {
					obj = u.Object
				}
			}
			if err := enc.Encode(map[string]any{"type": ev.Type, "object": obj}); err != nil {
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
		}
	}
}

const metaGV = "meta.k8s.io/v1"

// metadataOnly says the client asked for PartialObjectMetadata (the
// metadata informers of the garbage collector and the namespace
// controller do).
func metadataOnly(r *http.Request) bool {
	return strings.Contains(r.Header.Get("Accept"), "as=PartialObjectMetadata")
}

// shape returns obj as the client asked for it: whole, or its metadata.
func (s *Server) shape(r *http.Request, obj map[string]any) map[string]any {
	if !metadataOnly(r) {
		return obj
	}
	return map[string]any{"apiVersion": metaGV, "kind": "PartialObjectMetadata", "metadata": obj["metadata"]}
}

// serveDiscovery answers the discovery and health paths.
func (s *Server) serveDiscovery(w http.ResponseWriter, r *http.Request) bool {
	if r.Method != http.MethodGet {
		return false
	}
	group := metav1.APIGroup{TypeMeta: metav1.TypeMeta{Kind: "APIGroup", APIVersion: "v1"}, Name: templates.Group,
		Versions:         []metav1.GroupVersionForDiscovery{{GroupVersion: gv, Version: templates.APIVersion}},
		PreferredVersion: metav1.GroupVersionForDiscovery{GroupVersion: gv, Version: templates.APIVersion}}
	switch strings.TrimSuffix(r.URL.Path, "/") {
	case "":
		httperr.WriteJSON(w, http.StatusOK, metav1.RootPaths{Paths: []string{"/apis", "/apis/" + templates.Group, "/apis/" + gv}})
	case "/apis":
		httperr.WriteJSON(w, http.StatusOK, metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"},
			Groups: []metav1.APIGroup{group}})
	case "/apis/" + templates.Group:
		httperr.WriteJSON(w, http.StatusOK, group)
	case "/apis/" + gv:
		httperr.WriteJSON(w, http.StatusOK, metav1.APIResourceList{TypeMeta: metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"},
			// Alphabetical, as kube-apiserver lists them: kubectl maps a kind
			// to the last resource that serves it, which must be templates.
			GroupVersion: gv, APIResources: []metav1.APIResource{
				{Name: "processedtemplates", SingularName: "processedtemplate", Namespaced: true, Kind: "Template", Verbs: metav1.Verbs{"create"}},
				{Name: "templates", SingularName: "template", Namespaced: true, Kind: "Template",
					Verbs: metav1.Verbs{"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}},
			}})
	case "/healthz":
		httperr.WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	case "/openapi/v2":
		httperr.WriteJSON(w, http.StatusOK, map[string]any{"swagger": "2.0", "info": map[string]any{"title": "template.openshift.io", "version": "v1"}, "paths": map[string]any{}})
	case "/openapi/v3":
		httperr.WriteJSON(w, http.StatusOK, map[string]any{"paths": map[string]any{}})
	default:
		return false
	}
	return true
}

var _ http.Handler = (*Server)(nil)
