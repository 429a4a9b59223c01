// Package nodereads serves nodereads.nodevirt.io, the brain's aggregated
// API through which node agents read Secrets and ConfigMaps (the contract,
// and what is served when, is in clusterbrain/api/nodereads). It answers
// only node agents (rbac.NodeOf of the user kube-apiserver authenticated),
// and only with what an object placed on that very node names; it reads
// with the brain's own credentials. Nodes' RBAC has no Secret or ConfigMap
// rule at all, so this is their only way to them.
package nodereads

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	authv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	api "github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
)

// ServiceName fronts the API in the brain's namespace.
const ServiceName = "nodevirt-nodereads"

// DefaultAddr is where the API listens by default.
const DefaultAddr = ":8449"

// Config configures the server.
type Config struct {
	Kube    kubernetes.Interface
	Dynamic dynamic.Interface
	Virt    *client.Set
	// Namespace is the brain's: the Service, certificates, and the
	// ConfigMaps served as brainconfigmaps.
	Namespace string
	// Addr is the listen address (DefaultAddr when empty; not loopback).
	Addr string
	// TLSProfile is the KubeVirt CR's TLS settings for the server (nil:
	// TLS 1.2 and Go's suites).
	TLSProfile *tlsprofile.Live
	Log        *slog.Logger
}

// Server is the nodereads.nodevirt.io aggregated API, a brain role.
type Server struct {
	cfg Config
	agg *aggregated.Server
}

// New defaults and validates cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Kube == nil || cfg.Dynamic == nil || cfg.Virt == nil || cfg.Namespace == "" {
		return nil, errors.New("nodereads: kube, dynamic and kubevirt clients and a namespace are required")
	}
	if cfg.Addr == "" {
		cfg.Addr = DefaultAddr
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	cfg.Log = cfg.Log.With("role", "node-reads")
	s := &Server{cfg: cfg}
	agg, err := aggregated.NewServer(aggregated.Config{Kube: cfg.Kube, Dynamic: cfg.Dynamic, Addr: cfg.Addr, Handler: s, TLSProfile: cfg.TLSProfile,
		Log: cfg.Log,
		Registration: aggregated.Registration{Group: api.Group, Versions: []string{api.Version},
			Namespace: cfg.Namespace, Service: ServiceName, GroupPriorityMinimum: 1000, VersionPriority: 15}})
	if err != nil {
		return nil, err
	}
	s.agg = agg
	return s, nil
}

// Name names the brain role.
func (s *Server) Name() string { return "node-reads" }

// Ready is closed once the API is registered and served.
func (s *Server) Ready() <-chan struct{} { return s.agg.Ready() }

// Run serves until ctx ends.
func (s *Server) Run(ctx context.Context) error { return s.agg.Run(ctx) }

var gv = api.Group + "/" + api.Version

// request is a parsed path:
// /apis/{group}/{version}/namespaces/{ns}/{referrer}/{name}/{what}/{object}.
type request struct {
	ref          api.Ref
	what, object string
}

func parse(path string) (request, bool) {
	parts := strings.Split(strings.Trim(path, "/"), "/")
	if len(parts) != 9 || parts[0] != "apis" || parts[1] != api.Group || parts[2] != api.Version || parts[3] != "namespaces" {
		return request{}, false
	}
	// path is the decoded URL path: a name cannot hide a "/" in it.
	for _, p := range parts {
		if p == "" || p == "." || p == ".." {
			return request{}, false
		}
	}
	return request{ref: api.Ref{Namespace: parts[4], Resource: parts[5], Name: parts[6]}, what: parts[7], object: parts[8]}, true
}

// ServeHTTP answers discovery and reads.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		httperr.WriteStatus(w, apierrors.NewMethodNotSupported(schema.GroupResource{Group: api.Group}, r.Method))
		return
	}
	if s.serveDiscovery(w, r) {
		return
	}
	req, ok := parse(r.URL.Path)
	if !ok {
		httperr.WriteStatus(w, apierrors.NewNotFound(schema.GroupResource{Group: api.Group}, r.URL.Path))
		return
	}
	u, ok := aggregated.UserFrom(r.Context())
	if !ok {
		httperr.WriteStatus(w, apierrors.NewUnauthorized("no user"))
		return
	}
	log := s.cfg.Log.With("user", u.Name, "namespace", req.ref.Namespace, "referrer", req.ref.Resource+"/"+req.ref.Name,
		"read", req.what+"/"+req.object)
	obj, err := s.read(r.Context(), u, req)
	if err != nil {
		if apierrors.IsForbidden(err) {
			log.Warn("node read refused", "err", err)
		}
		httperr.WriteStatus(w, err)
		return
	}
	log.Debug("node read served")
	_ = httperr.WriteJSON(w, http.StatusOK, obj)
}

// read checks that req's referrer is on the caller's node and names the
// object, then reads it.
func (s *Server) read(ctx context.Context, u aggregated.User, req request) (any, error) {
	node, ok := rbac.NodeOf(u.Name, u.Groups, u.Extra)
	if !ok {
		return nil, s.forbidden(u, req, "only node agents read through this API")
	}
	ns := req.ref.Namespace
	var allowed names
	switch req.ref.Resource {
	case api.VMIs:
		vmi, err := s.cfg.Virt.VMIs.Get(ctx, ns, req.ref.Name)
		if err != nil {
			return nil, err
		}
		on, err := s.vmiOnNode(ctx, vmi, node)
		if err != nil {
			return nil, err
		}
		if !on {
			return nil, s.forbidden(u, req, fmt.Sprintf("virtualmachineinstance %s/%s is not on node %s", ns, vmi.Name, node))
		}
		allowed = vmiNames(vmi)
	case api.DataVolumes:
		dv, err := s.cfg.Virt.DataVolumes.Get(ctx, ns, req.ref.Name)
		if err != nil {
			return nil, err
		}
		// A DataVolume's claim has its name.
		if _, on, err := s.claimOnNode(ctx, ns, dv.Name, node); err != nil && !apierrors.IsNotFound(err) {
			return nil, err
		} else if !on {
			return nil, s.forbidden(u, req, fmt.Sprintf("the claim of datavolume %s/%s is not placed on node %s", ns, dv.Name, node))
		}
		allowed = dataVolumeNames(dv)
		if req.what == api.BrainConfigMaps {
			return s.proxyCA(ctx, u, req)
		}
	case api.Claims:
		if req.what != api.BrainConfigMaps {
			break
		}
		return s.cloneRequest(ctx, u, req, node)
	}
	switch req.what {
	case api.Secrets:
		if req.ref.Resource != api.Claims && contains(allowed.secrets, req.object) {
			sec, err := s.cfg.Kube.CoreV1().Secrets(ns).Get(ctx, req.object, metav1.GetOptions{})
			if err != nil {
				return nil, err
			}
			sec.APIVersion, sec.Kind = "v1", "Secret"
			return sec, nil
		}
	case api.ConfigMaps:
		if req.ref.Resource != api.Claims && contains(allowed.configMaps, req.object) {
			return s.configMap(ctx, ns, req.object)
		}
	}
	return nil, s.forbidden(u, req, fmt.Sprintf("%s does not name %s %s", req.ref, req.what, req.object))
}

// proxyCA serves the import proxy's CA ConfigMap (CDI configuration
// importProxy.trustedCAProxy, in the brain's namespace) for a DataVolume
// already found on the node.
func (s *Server) proxyCA(ctx context.Context, u aggregated.User, req request) (any, error) {
	cfg, err := s.cfg.Virt.CDIConfig(ctx)
	if err != nil {
		return nil, err
	}
	if cfg == nil || cfg.ImportProxy == nil || cfg.ImportProxy.TrustedCAProxy == nil || *cfg.ImportProxy.TrustedCAProxy != req.object {
		return nil, s.forbidden(u, req, "not the import proxy's trusted CA of the CDI configuration")
	}
	return s.configMap(ctx, s.cfg.Namespace, req.object)
}

// configMap reads a ConfigMap, with its kind.
func (s *Server) configMap(ctx context.Context, namespace, name string) (*corev1.ConfigMap, error) {
	cm, err := s.cfg.Kube.CoreV1().ConfigMaps(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	cm.APIVersion, cm.Kind = "v1", "ConfigMap"
	return cm, nil
}

// cloneRequest serves a claim's clone request (importstate) to the node
// that fills the claim or to the one that holds its source.
func (s *Server) cloneRequest(ctx context.Context, u aggregated.User, req request, node string) (any, error) {
	pvc, err := s.cfg.Kube.CoreV1().PersistentVolumeClaims(req.ref.Namespace).Get(ctx, req.ref.Name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	if req.object != importstate.CloneRequestName(pvc.UID) {
		return nil, s.forbidden(u, req, "not the clone request of the claim")
	}
	cm, err := s.configMap(ctx, s.cfg.Namespace, req.object)
	if err != nil {
		return nil, err
	}
	cr, err := importstate.ReadCloneRequest(cm, pvc)
	if err != nil {
		return nil, s.forbidden(u, req, err.Error())
	}
	target, err := s.claimNode(ctx, pvc)
	if err != nil {
		return nil, err
	}
	if target == node {
		return cm, nil
	}
	if cr.SourceKind == importstate.CloneSourceClaim {
		if _, on, err := s.claimOnNode(ctx, cr.SourceNamespace, cr.SourceName, node); err == nil && on {
			return cm, nil
		}
	}
	return nil, s.forbidden(u, req, fmt.Sprintf("neither the claim nor its clone source is on node %s", node))
}

func (s *Server) forbidden(u aggregated.User, req request, why string) error {
	return aggregated.Forbidden(u, authzAttrs(req), why)
}

func (s *Server) serveDiscovery(w http.ResponseWriter, r *http.Request) bool {
	group := metav1.APIGroup{TypeMeta: metav1.TypeMeta{Kind: "APIGroup", APIVersion: "v1"}, Name: api.Group,
		Versions:         []metav1.GroupVersionForDiscovery{{GroupVersion: gv, Version: api.Version}},
		PreferredVersion: metav1.GroupVersionForDiscovery{GroupVersion: gv, Version: api.Version}}
	switch strings.TrimSuffix(r.URL.Path, "/") {
	case "":
		_ = httperr.WriteJSON(w, http.StatusOK, metav1.RootPaths{Paths: []string{"/apis", "/apis/" + api.Group, "/apis/" + gv}})
	case "/apis":
		_ = httperr.WriteJSON(w, http.StatusOK, metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"},
			Groups: []metav1.APIGroup{group}})
	case "/apis/" + api.Group:
		_ = httperr.WriteJSON(w, http.StatusOK, group)
	case "/apis/" + gv:
		list := metav1.APIResourceList{TypeMeta: metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"}, GroupVersion: gv}
		for _, sub := range api.Subresources {
			kind := "Secret"
			if !strings.HasSuffix(sub, "/"+api.Secrets) {
				kind = "ConfigMap"
			}
			list.APIResources = append(list.APIResources, metav1.APIResource{Name: sub, Namespaced: true, Kind: kind, Verbs: metav1.Verbs{"get"}})
		}
		_ = httperr.WriteJSON(w, http.StatusOK, list)
	case "/healthz":
		_ = httperr.WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	case "/openapi/v2":
		_ = httperr.WriteJSON(w, http.StatusOK, map[string]any{"swagger": "2.0", "info": map[string]any{"title": api.Group, "version": api.Version}, "paths": map[string]any{}})
	case "/openapi/v3":
		_ = httperr.WriteJSON(w, http.StatusOK, map[string]any{"paths": map[string]any{}})
	default:
		return false
	}
	return true
}

var _ http.Handler = (*Server)(nil)

// authzAttrs is what kube-apiserver authorized for req.
func authzAttrs(req request) authv1.ResourceAttributes {
	return authv1.ResourceAttributes{Namespace: req.ref.Namespace, Verb: "get", Group: api.Group, Version: api.Version,
		Resource: req.ref.Resource, Subresource: req.what, Name: req.ref.Name}
}
