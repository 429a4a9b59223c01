// Package subresources serves subresources.kubevirt.io (v1 and v1alpha3) as
// an aggregated API behind kube-apiserver, the virt-api role: VM start,
// stop, restart, migrate and expand-spec act on the API objects, and so do
// addvolume and removevolume on VMs and VMIs (hotplug.go); VMI pause,
// unpause, softreboot, freeze, unfreeze, guest-agent reads and the console
// and VNC streams are forwarded to the nodeagent running the VMI (see
// NodeClient). Every request
// is authorized by a SubjectAccessReview on the subresource, as KubeVirt's
// roles expect (see package rbac).
package subresources

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"

	authv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// Group is the API group served.
const Group = kubevirtv1.SubresourceGroupName

// Versions are served alike; v1 is preferred.
var Versions = []string{"v1", "v1alpha3"}

// ServiceName is the Service fronting the API (KubeVirt's is virt-api).
const ServiceName = "nodevirt-subresources"

// Config configures the subresource API server.
type Config struct {
	Kube    kubernetes.Interface
	Dynamic dynamic.Interface
	Virt    *client.Set
	// Namespace holds the Service, EndpointSlice and serving certificate.
	Namespace string
	// Addr is the listen address (default ":8443"); kube-apiserver dials
	// it, so it must not be loopback only.
	Addr string
	// Node reaches the nodeagents; nil builds an HTTPS client from NodeTLS.
	Node NodeClient
	// NodeTLS is the mutual-TLS configuration towards nodeagents, used when
	// Node is nil.
	NodeTLS *tls.Config
	// Version is what /version reports.
	Version Info
	// TLSProfile is the KubeVirt CR's TLS settings for the API's server
	// (nil: TLS 1.2 and Go's suites).
	TLSProfile *tlsprofile.Live
	// Rollout is the KubeVirt CR's hotplug gates: with declarative
	// hotplug, a VM's VMI takes no ephemeral volume and a VM's addvolume
	// changes only its template (nil: no KubeVirt CR, no declarative
	// hotplug).
	Rollout *live.Value[rollout.Cluster]
	Log     *slog.Logger
}

// Server is the subresource API.
type Server struct {
	cfg      Config
	agg      *aggregated.Server
	sessions sessions
}

// New validates cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Kube == nil || cfg.Dynamic == nil || cfg.Virt == nil || cfg.Namespace == "" {
		return nil, errors.New("subresources: kube, dynamic and virt clients and a namespace are required")
	}
	if cfg.Addr == "" {
		cfg.Addr = ":8443"
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Node == nil {
		if cfg.NodeTLS == nil {
			return nil, errors.New("subresources: a node client or its TLS configuration is required")
		}
		cfg.Node = NewHTTPSNodeClient(cfg.Kube, cfg.NodeTLS)
	}
	if cfg.Version.GitVersion == "" {
		cfg.Version = DefaultInfo()
	}
	s := &Server{cfg: cfg, sessions: sessions{active: map[string]*session{}}}
	agg, err := aggregated.NewServer(aggregated.Config{
		Kube: cfg.Kube, Dynamic: cfg.Dynamic, Addr: cfg.Addr, Handler: s, Public: public, Log: cfg.Log, TLSProfile: cfg.TLSProfile,
		Registration: aggregated.Registration{Group: Group, Versions: Versions, Namespace: cfg.Namespace, Service: ServiceName},
	})
	if err != nil {
		return nil, err
	}
	s.agg = agg
	return s, nil
}

// Name names the brain role.
func (s *Server) Name() string { return "subresources" }

// Run serves until ctx ends.
func (s *Server) Run(ctx context.Context) error { return s.agg.Run(ctx) }

// Ready is closed once the API is registered and served.
func (s *Server) Ready() <-chan struct{} { return s.agg.Ready() }

// Endpoint is the host:port kube-apiserver dials (valid after Ready).
func (s *Server) Endpoint() string { return s.agg.Registration().Endpoint() }

// public paths are served without a user besides discovery, like virt-api's.
func public(r *http.Request) bool {
	p := strings.TrimSuffix(r.URL.Path, "/")
	for _, v := range Versions {
		base := "/apis/" + Group + "/" + v
		switch p {
		case base + "/version", base + "/healthz", base + "/guestfs", "/openapi/v3/apis/" + Group + "/" + v:
			return true
		}
	}
	return false
}

// request is a parsed subresource path.
type request struct {
	version, namespace, resource, name, subresource string
}

// parse splits /apis/subresources.kubevirt.io/{v}/namespaces/{ns}/{resource}/{name}/{sub...}.
func parse(path string) (request, bool) {
	parts := strings.Split(strings.Trim(path, "/"), "/")
	if len(parts) < 6 || parts[0] != "apis" || parts[1] != Group || parts[3] != "namespaces" {
		return request{}, false
	}
	r := request{version: parts[2], namespace: parts[4], resource: parts[5]}
	if len(parts) >= 7 {
		r.name = parts[6]
	}
	if len(parts) >= 8 {
		r.subresource = strings.Join(parts[7:], "/")
	}
	return r, true
}

// ServeHTTP routes discovery, health and subresource requests; a failed
// request is answered with its error's Kubernetes Status (httperr).
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.serveDiscovery(w, r) {
		return
	}
	if err := s.serve(w, r); err != nil {
		httperr.WriteStatus(w, err)
	}
}

// serve authorizes and runs the subresource request r.
func (s *Server) serve(w http.ResponseWriter, r *http.Request) error {
	req, ok := parse(r.URL.Path)
	if !ok || !validVersion(req.version) {
		return apierrors.NewNotFound(kubevirtv1.Resource("subresource"), r.URL.Path)
	}
	h, verb, sar := s.route(req, r.Method)
	if h == nil {
		return apierrors.NewNotFound(kubevirtv1.Resource(req.resource+"/"+req.subresource), req.name)
	}
	if err := s.authorize(r, req, verb, sar); err != nil {
		return err
	}
	log := s.cfg.Log.With("namespace", req.namespace, "name", req.name, "subresource", req.subresource)
	log.Debug("subresource request", "method", r.Method)
	return h(w, r, req, log)
}

// handler serves one subresource; it writes the answer of a success and
// returns the error of a failure.
type handler func(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error

// route is one subresource served: discovery lists exactly these.
type route struct {
	resource, sub, method string
	h                     handler
}

// routes are the subresources served. A sub ending in "/" takes the rest
// of the path as parameters (portforward/{port}[/{protocol}]).
func (s *Server) routes() []route {
	return []route{
		{"virtualmachines", "start", http.MethodPut, s.startVM},
		{"virtualmachines", "stop", http.MethodPut, s.stopVM},
		{"virtualmachines", "restart", http.MethodPut, s.restartVM},
		{"virtualmachines", "migrate", http.MethodPut, s.migrateVM},
		{"virtualmachines", "expand-spec", http.MethodGet, s.expandVMSpec},
		{"virtualmachines", portForwardSub + "/", http.MethodGet, s.portForward},
		{"virtualmachines", "addvolume", http.MethodPut, s.volumeVM(true)},
		{"virtualmachines", "removevolume", http.MethodPut, s.volumeVM(false)},
		{"virtualmachines", "objectgraph", http.MethodGet, s.objectGraph(s.vmGraph)},
		{"virtualmachines", "evacuate/cancel", http.MethodPut, s.evacuateCancelVM},
		{"virtualmachineinstances", "pause", http.MethodPut, s.pauseVMI},
		{"virtualmachineinstances", "unpause", http.MethodPut, s.unpauseVMI},
		{"virtualmachineinstances", "softreboot", http.MethodPut, s.softRebootVMI},
		{"virtualmachineinstances", "reset", http.MethodPut, s.resetVMI},
		{"virtualmachineinstances", "guestosinfo", http.MethodGet, s.guestAgentGet("guestosinfo")},
		{"virtualmachineinstances", "userlist", http.MethodGet, s.guestAgentGet("userlist")},
		{"virtualmachineinstances", "filesystemlist", http.MethodGet, s.guestAgentGet("filesystemlist")},
		{"virtualmachineinstances", "console", http.MethodGet, s.stream("console")},
		{"virtualmachineinstances", "vnc", http.MethodGet, s.stream("vnc")},
		{"virtualmachineinstances", "vnc/screenshot", http.MethodGet, s.screenshot},
		{"virtualmachineinstances", portForwardSub + "/", http.MethodGet, s.portForward},
		{"virtualmachineinstances", "addvolume", http.MethodPut, s.volumeVMI(true)},
		{"virtualmachineinstances", "removevolume", http.MethodPut, s.volumeVMI(false)},
		{"virtualmachineinstances", "freeze", http.MethodPut, s.freezeVMI},
		{"virtualmachineinstances", "unfreeze", http.MethodPut, s.unfreezeVMI},
		{"virtualmachineinstances", "objectgraph", http.MethodGet, s.objectGraph(s.vmiGraph)},
		{"virtualmachineinstances", "evacuate/cancel", http.MethodPut, s.evacuateCancelVMI},
		{"expand-vm-spec", "", http.MethodPut, s.expandSpecBody},
	}
}

// route returns the handler of method on req, the RBAC verb and the
// subresource the access review names (the first segment of a
// parameterized one, as virt-api's).
func (s *Server) route(req request, method string) (handler, string, string) {
	for _, rt := range s.routes() {
		if rt.resource != req.resource || rt.method != method {
			continue
		}
		sar := rt.sub
		if strings.HasSuffix(rt.sub, "/") {
			if !strings.HasPrefix(req.subresource, rt.sub) {
				continue
			}
			sar = strings.TrimSuffix(rt.sub, "/")
		} else if rt.sub != req.subresource {
			continue
		}
		if method == http.MethodGet {
			return rt.h, "get", sar
		}
		return rt.h, "update", sar
	}
	return nil, "", ""
}

// authorize runs the SubjectAccessReview virt-api runs: the verb of the
// HTTP method on resource/subresource in the subresource group.
func (s *Server) authorize(r *http.Request, req request, verb, subresource string) error {
	u, ok := aggregated.UserFrom(r.Context())
	if !ok {
		return apierrors.NewUnauthorized("request not authenticated by the aggregator")
	}
	attrs := authv1.ResourceAttributes{Namespace: req.namespace, Verb: verb, Group: Group, Version: req.version,
		Resource: req.resource, Subresource: subresource, Name: req.name}
	allowed, reason, err := aggregated.Authorize(r.Context(), s.cfg.Kube, u, attrs)
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	if !allowed {
		s.cfg.Log.Info("subresource refused", "user", u.Name, "namespace", req.namespace, "name", req.name,
			"resource", req.resource, "subresource", req.subresource, "verb", verb)
		return aggregated.Forbidden(u, attrs, reason)
	}
	return nil
}

func validVersion(v string) bool {
	for _, x := range Versions {
		if v == x {
			return true
		}
	}
	return false
}

// sessions tracks the open console and VNC streams, one per VMI and kind:
// a new connection replaces the old one, as in KubeVirt.
type sessions struct {
	mu     sync.Mutex
	active map[string]*session
}

type session struct {
	close func()
	done  chan struct{}
}
