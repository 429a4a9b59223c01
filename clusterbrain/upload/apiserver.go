package upload

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	uploadv1beta1 "kubevirt.io/containerized-data-importer-api/pkg/apis/upload/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

const (
	group      = "upload.cdi.kubevirt.io"
	version    = "v1beta1"
	resource   = "uploadtokenrequests"
	apiService = "nodevirt-upload-api"

	authConfigMap = "extension-apiserver-authentication"
)

// frontProxyAuth is how the API server vouches for the user it forwards:
// a client certificate from the requestheader CA, and headers.
type frontProxyAuth struct {
	pool         *x509.CertPool
	allowedNames []string
	userHeaders  []string
	groupHeaders []string
	extraPrefix  []string
}

// loadAuth reads the requestheader settings kube-apiserver publishes.
func (s *Server) loadAuth(ctx context.Context) error {
	cm, err := s.kube.CoreV1().ConfigMaps("kube-system").Get(ctx, authConfigMap, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read kube-system/%s: %w", authConfigMap, err)
	}
	a := &frontProxyAuth{pool: x509.NewCertPool()}
	if !a.pool.AppendCertsFromPEM([]byte(cm.Data["requestheader-client-ca-file"])) {
		return fmt.Errorf("kube-system/%s has no requestheader client ca", authConfigMap)
	}
	for key, dst := range map[string]*[]string{
		"requestheader-allowed-names":        &a.allowedNames,
		"requestheader-username-headers":     &a.userHeaders,
		"requestheader-group-headers":        &a.groupHeaders,
		"requestheader-extra-headers-prefix": &a.extraPrefix,
	} {
		if v := cm.Data[key]; v != "" {
			if err := json.Unmarshal([]byte(v), dst); err != nil {
				return fmt.Errorf("kube-system/%s %s: %w", authConfigMap, key, err)
			}
		}
	}
	if len(a.userHeaders) == 0 {
		a.userHeaders = []string{"X-Remote-User"}
	}
	if len(a.groupHeaders) == 0 {
		a.groupHeaders = []string{"X-Remote-Group"}
	}
	s.auth.Store(a)
	return nil
}

func (s *Server) refreshAuth(ctx context.Context) {
	t := time.NewTicker(30 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := s.loadAuth(ctx); err != nil && ctx.Err() == nil {
				s.log.Warn("front-proxy settings not refreshed", "err", err)
			}
		}
	}
}

func (s *Server) apiTLSConfig(*tls.ClientHelloInfo) (*tls.Config, error) {
	return &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{s.apiCert},
		ClientAuth:   tls.VerifyClientCertIfGiven,
		ClientCAs:    s.auth.Load().pool,
	}, nil
}

func (s *Server) apiHandler() http.Handler {
	gv := group + "/" + version
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	groupInfo := metav1.APIGroup{TypeMeta: metav1.TypeMeta{Kind: "APIGroup", APIVersion: "v1"}, Name: group,
		Versions:         []metav1.GroupVersionForDiscovery{{GroupVersion: gv, Version: version}},
		PreferredVersion: metav1.GroupVersionForDiscovery{GroupVersion: gv, Version: version}}
	mux.HandleFunc("GET /apis", func(w http.ResponseWriter, _ *http.Request) {
		_ = httperr.WriteJSON(w, http.StatusOK, metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"},
			Groups: []metav1.APIGroup{groupInfo}})
	})
	mux.HandleFunc("GET /apis/"+group, func(w http.ResponseWriter, _ *http.Request) { _ = httperr.WriteJSON(w, http.StatusOK, groupInfo) })
	mux.HandleFunc("GET /apis/"+gv, func(w http.ResponseWriter, _ *http.Request) {
		_ = httperr.WriteJSON(w, http.StatusOK, metav1.APIResourceList{TypeMeta: metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"},
			GroupVersion: gv, APIResources: []metav1.APIResource{{Name: resource, SingularName: "uploadtokenrequest",
				Namespaced: true, Kind: "UploadTokenRequest", Verbs: metav1.Verbs{"create"}}}})
	})
	mux.Handle("POST /apis/"+gv+"/namespaces/{namespace}/"+resource, httperr.StatusHandler(s.createToken))
	return mux
}

// createToken serves POST .../namespaces/{ns}/uploadtokenrequests.
func (s *Server) createToken(w http.ResponseWriter, r *http.Request) error {
	ns := r.PathValue("namespace")
	user, groups, extra, err := s.authenticate(r)
	if err != nil {
		return httperr.With(http.StatusUnauthorized, err)
	}
	sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User: user, Groups: groups, Extra: extra,
		ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: ns, Verb: "create", Group: group, Version: version, Resource: resource},
	}}
	res, err := s.kube.AuthorizationV1().SubjectAccessReviews().Create(r.Context(), sar, metav1.CreateOptions{})
	if err != nil {
		s.log.Error("subject access review failed", "namespace", ns, "user", user, "err", err)
		return httperr.New(http.StatusInternalServerError, "authorization check failed")
	}
	if !res.Status.Allowed {
		return httperr.Forbidden("user %q cannot create %s.%s in namespace %q: %s", user, resource, group, ns, res.Status.Reason)
	}
	var req uploadv1beta1.UploadTokenRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		return httperr.BadRequest("decode upload token request: %v", err)
	}
	if req.Namespace != "" && req.Namespace != ns {
		return httperr.BadRequest("the namespace of the object does not match the namespace of the request")
	}
	if req.Spec.PvcName == "" {
		return httperr.New(http.StatusUnprocessableEntity, "spec.pvcName is required")
	}
	token, err := s.signer.Issue(ns, req.Spec.PvcName)
	if err != nil {
		return httperr.New(http.StatusInternalServerError, "issue token: %v", err)
	}
	s.log.Info("issued upload token", "namespace", ns, "pvc", req.Spec.PvcName, "user", user)
	req.APIVersion, req.Kind = group+"/"+version, "UploadTokenRequest"
	req.Namespace = ns
	req.CreationTimestamp = metav1.Now()
	req.Status.Token = token
	return httperr.WriteJSON(w, http.StatusCreated, req)
}

// authenticate returns the user the front proxy vouches for.
func (s *Server) authenticate(r *http.Request) (string, []string, map[string]authorizationv1.ExtraValue, error) {
	a := s.auth.Load()
	if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
		return "", nil, nil, errors.New("request is not authenticated: no front-proxy client certificate")
	}
	cn := r.TLS.VerifiedChains[0][0].Subject.CommonName
	if len(a.allowedNames) > 0 && !slices.Contains(a.allowedNames, cn) {
		return "", nil, nil, fmt.Errorf("request is not authenticated: client %q is not an allowed front proxy", cn)
	}
	user := ""
	for _, h := range a.userHeaders {
		if user = r.Header.Get(h); user != "" {
			break
		}
	}
	if user == "" {
		return "", nil, nil, errors.New("request is not authenticated: no user header")
	}
	var groups []string
	for _, h := range a.groupHeaders {
		groups = append(groups, r.Header.Values(h)...)
	}
	extra := map[string]authorizationv1.ExtraValue{}
	for _, prefix := range a.extraPrefix {
		for k, v := range r.Header {
			if rest, ok := strings.CutPrefix(strings.ToLower(k), strings.ToLower(prefix)); ok && rest != "" {
				extra[rest] = append(extra[rest], v...)
			}
		}
	}
	return user, groups, extra, nil
}

// register publishes the aggregated API: a Service without selector, its
// EndpointSlice pointing at this brain, and the APIService.
func (s *Server) register(ctx context.Context) error {
	ns := s.cfg.Namespace
	ip, err := s.advertiseIP()
	if err != nil {
		return err
	}
	port := s.apiPort()
	labels := map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}
	svc := map[string]any{
		"apiVersion": "v1", "kind": "Service",
		"metadata": map[string]any{"name": apiService, "namespace": ns, "labels": labels},
		"spec": map[string]any{"type": "ClusterIP", "ports": []any{map[string]any{
			"name": "https", "port": 443, "protocol": "TCP", "targetPort": port}}},
	}
	slice := map[string]any{
		"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
		"metadata": map[string]any{"name": apiService, "namespace": ns, "labels": map[string]string{
			"kubernetes.io/service-name": apiService, "endpointslice.kubernetes.io/managed-by": "nodevirt.io-clusterbrain",
			"app.kubernetes.io/managed-by": "nodevirt"}},
		"addressType": "IPv4",
		"endpoints":   []any{map[string]any{"addresses": []string{ip.String()}, "conditions": map[string]any{"ready": true}}},
		"ports":       []any{map[string]any{"name": "https", "port": port, "protocol": "TCP"}},
	}
	apisvc := map[string]any{
		"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
		"metadata": map[string]any{"name": version + "." + group, "labels": labels},
		"spec": map[string]any{"group": group, "version": version, "groupPriorityMinimum": 1000, "versionPriority": 15,
			"caBundle": s.ca.CertPEM, "service": map[string]any{"namespace": ns, "name": apiService, "port": 443}},
	}
	for path, obj := range map[string]any{
		"/api/v1/namespaces/" + ns + "/services/" + apiService:                         svc,
		"/apis/discovery.k8s.io/v1/namespaces/" + ns + "/endpointslices/" + apiService: slice,
		"/apis/apiregistration.k8s.io/v1/apiservices/" + version + "." + group:         apisvc,
	} {
		if err := s.apply(ctx, path, obj); err != nil {
			return err
		}
	}
	return nil
}

// apply server-side-applies obj at path.
func (s *Server) apply(ctx context.Context, path string, obj any) error {
	data, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	err = s.kube.Discovery().RESTClient().Patch(types.ApplyPatchType).AbsPath(path).
		Param("fieldManager", "nodevirt-upload").Param("force", "true").Body(data).Do(ctx).Error()
	if err != nil {
		return fmt.Errorf("apply %s: %w", path, err)
	}
	return nil
}
