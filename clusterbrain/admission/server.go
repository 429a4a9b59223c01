// Package admission is the brain's HTTPS admission webhook server: it
// serves every webhook of the brain (its own VM/VMI defaulting and
// validation, the MAC pool, and paths other roles register) with a
// certificate from the brain's own CA, and keeps the Mutating and
// Validating webhook configurations pointing at it with that CA's bundle.
package admission

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// Names of the webhook configurations the brain owns.
const (
	MutatingConfigName   = "nodevirt-brain-mutator"
	ValidatingConfigName = "nodevirt-brain-validator"
)

// AdmitFunc decides one admission request. It returns nil to allow the
// request unchanged.
type AdmitFunc func(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse

// Webhook is one entry of the brain's webhook configurations, served on
// Path of the brain's server.
type Webhook struct {
	// Name is the webhook's fully qualified name, e.g.
	// "mutatevirtualmachines.kubemacpool.io".
	Name     string
	Path     string
	Mutating bool
	Rules    []admissionregistrationv1.RuleWithOperations
	// NamespaceSelector and ObjectSelector narrow what is sent (nil: all).
	NamespaceSelector *metav1.LabelSelector
	ObjectSelector    *metav1.LabelSelector
	// MatchConditions are CEL expressions that must all hold for a
	// request to be sent (nil: every request the rules match).
	MatchConditions []admissionregistrationv1.MatchCondition
	// Ignore makes the apiserver admit when the brain is unreachable;
	// the default is to fail the request.
	Ignore bool
	// SideEffects says the handler writes other objects except on dry run.
	SideEffects bool
	// Timeout defaults to 10s.
	Timeout time.Duration
	Admit   AdmitFunc
}

// Config configures the server.
type Config struct {
	// Addr is where the server listens (default 127.0.0.1:8443).
	Addr string
	// URL is the base URL the apiserver calls (default https://<listen
	// address>) when there is no Service.
	URL string
	// Service, "namespace/name", makes the webhook configurations name a
	// selector-less Service whose EndpointSlice lists every brain (Addr
	// then must not be loopback), so that every API server reaches a brain
	// wherever the brains run. Empty: the configurations carry URL, which
	// each API server must reach (loopback: a brain on its own host).
	Service string
	// Namespace holds the certificate secrets.
	Namespace string
	// Certs overrides certificate settings; Kube, Namespace and
	// PublishBundle are filled in by the server.
	Certs certs.Config
	// TLSProfile is the KubeVirt CR's TLS settings for the server (nil:
	// TLS 1.2 and Go's suites).
	TLSProfile *tlsprofile.Live
}

// Deps are the clients the server and its contributors use.
type Deps struct {
	Kube kubernetes.Interface
	Virt *client.Set
	Log  *slog.Logger
}

// Server is the brain's webhook server.
type Server struct {
	cfg  Config
	deps Deps
	log  *slog.Logger
	cm   *certs.Manager
	mux  *http.ServeMux

	mu       sync.Mutex
	webhooks []Webhook
	paths    map[string]bool
	target   Target // zero before Run listens
	runners  []func(context.Context) error
	onPub    []func(ctx context.Context, t Target, bundle []byte) error
	ready    chan struct{}
}

// Target is where the API servers call the server: a base URL, or a
// Service (port 443) in front of every brain.
type Target struct {
	URL     string
	Service *aggregated.Registration
}

func (t Target) zero() bool { return t.URL == "" && t.Service == nil }

// ClientConfig is how a webhook configuration names path of the target,
// trusted through bundle.
func (t Target) ClientConfig(path string, bundle []byte) admissionregistrationv1.WebhookClientConfig {
	if t.Service != nil {
		port := int32(443)
		return admissionregistrationv1.WebhookClientConfig{CABundle: bundle, Service: &admissionregistrationv1.ServiceReference{
			Namespace: t.Service.Namespace, Name: t.Service.Service, Path: &path, Port: &port}}
	}
	url := t.URL + path
	return admissionregistrationv1.WebhookClientConfig{URL: &url, CABundle: bundle}
}

// New defaults and validates cfg and builds a server with no webhooks.
func New(cfg Config, deps Deps) (*Server, error) {
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:8443"
	}
	if cfg.Namespace == "" {
		return nil, errors.New("admission: namespace is required")
	}
	if deps.Kube == nil {
		return nil, errors.New("admission: kube client is required")
	}
	if deps.Log == nil {
		deps.Log = slog.Default()
	}
	s := &Server{cfg: cfg, deps: deps, log: deps.Log.With("role", "admission"), mux: http.NewServeMux(),
		paths: map[string]bool{}, ready: make(chan struct{})}
	cc := cfg.Certs
	cc.Kube, cc.Namespace, cc.Log = deps.Kube, cfg.Namespace, s.log
	if cfg.Service != "" {
		ns, name, ok := strings.Cut(cfg.Service, "/")
		if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
			return nil, fmt.Errorf("admission: service %q is not namespace/name", cfg.Service)
		}
		if cfg.URL != "" {
			return nil, errors.New("admission: a service and a url exclude each other")
		}
		if cc.Hosts == nil {
			cc.Hosts = aggregated.Registration{Namespace: ns, Service: name}.Hosts()
		}
	}
	cc.PublishBundle = s.publish
	cm, err := certs.New(cc)
	if err != nil {
		return nil, err
	}
	s.cm = cm
	return s, nil
}

// Deps returns the clients the server was built with.
func (s *Server) Deps() Deps { return s.deps }

// Certs returns the server's certificate manager.
func (s *Server) Certs() *certs.Manager { return s.cm }

// Ready is closed once the server listens and its configurations are
// published.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// Target returns where the apiserver calls the server (zero before Run
// listens).
func (s *Server) Target() Target {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.target
}

// Handle serves h on path. Handle alone adds no webhook entry; use Register
// for that.
func (s *Server) Handle(path string, h AdmitFunc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.paths[path] {
		panic(fmt.Sprintf("admission: path %s registered twice", path))
	}
	s.paths[path] = true
	s.mux.Handle(path, s.review(path, h))
}

// HandleHTTP serves h on path as it is (for reviews that are not
// admission reviews, such as a CRD's ConversionReview).
func (s *Server) HandleHTTP(path string, h http.Handler) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.paths[path] {
		panic(fmt.Sprintf("admission: path %s registered twice", path))
	}
	s.paths[path] = true
	s.mux.Handle(path, h)
}

// OnPublish calls f with the server's target and CA bundle each time the
// webhook configurations are published (start, CA rotation, takeover), so
// that other registrations naming this server (a CRD's conversion webhook)
// follow it.
func (s *Server) OnPublish(f func(ctx context.Context, t Target, bundle []byte) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onPub = append(s.onPub, f)
}

// Register serves w.Admit on w.Path and adds w to the webhook
// configurations (republished at once when the server already runs).
func (s *Server) Register(w Webhook) {
	s.Handle(w.Path, w.Admit)
	s.mu.Lock()
	s.webhooks = append(s.webhooks, w)
	running := !s.target.zero()
	s.mu.Unlock()
	if running {
		if err := s.publish(context.Background(), s.cm.CABundle()); err != nil {
			s.log.Error("publish webhooks", "err", err)
		}
	}
}

// Go runs f beside the server for as long as it runs (a contributor's
// informers, for instance).
func (s *Server) Go(f func(context.Context) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runners = append(s.runners, f)
}

// Name implements the brain's Role.
func (s *Server) Name() string { return "admission" }

// Run listens, obtains a certificate, publishes the webhook
// configurations and serves until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", s.cfg.Addr, err)
	}
	defer ln.Close()
	target := Target{URL: s.cfg.URL}
	if ns, name, ok := strings.Cut(s.cfg.Service, "/"); ok {
		reg := aggregated.Registration{Namespace: ns, Service: name}
		if err := reg.Resolve(ln.Addr()); err != nil {
			return fmt.Errorf("webhooks: %w", err)
		}
		target = Target{Service: &reg}
	} else if target.URL == "" {
		target.URL = "https://" + ln.Addr().String()
	}
	s.mu.Lock()
	s.target = target
	runners := s.runners
	s.mu.Unlock()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, f := range runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(ctx); err != nil && ctx.Err() == nil {
				s.log.Error("admission runner stopped", "err", err)
			}
		}()
	}
	if err := s.firstSync(ctx); err != nil {
		return nil // ctx ended
	}
	wg.Add(1)
	go func() { defer wg.Done(); _ = s.cm.Run(ctx) }()

	srv := &http.Server{
		Handler:           s.mux,
		ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
		TLSConfig: s.tlsConfig(),
		ErrorLog:  slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	go func() {
		<-ctx.Done()
		shut, c := context.WithTimeout(context.Background(), 5*time.Second)
		defer c()
		_ = srv.Shutdown(shut)
	}()
	close(s.ready)
	// When the server the webhook configurations name (the brain that
	// published last) dies, this brain publishes its own.
	go aggregated.KeepRegistered(ctx, s.log, "webhook configurations", s.registrationAlive,
		func(ctx context.Context) error { return s.publish(ctx, s.cm.CABundle()) })
	if target.Service != nil {
		s.log.Info("serving webhooks", "service", s.cfg.Service, "endpoint", target.Service.Endpoint())
	} else {
		s.log.Info("serving webhooks", "url", target.URL)
	}
	if err := srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// firstSync obtains the first certificate and publishes the webhook
// configurations, trying again until it succeeds or ctx ends: another
// replica may be creating the shared CA at the same moment (AlreadyExists),
// and a brain's webhook server was once seen never to finish this step, so
// each attempt is bounded.
func (s *Server) firstSync(ctx context.Context) error {
	for retry := time.Second; ; retry = min(2*retry, 10*time.Second) {
		attempt, cancel := context.WithTimeout(ctx, 20*time.Second)
		_, err := s.cm.Sync(attempt)
		cancel()
		if err == nil || ctx.Err() != nil {
			return ctx.Err()
		}
		s.log.Warn("first certificate sync failed", "err", err, "retry", retry)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(retry):
		}
	}
}

func (s *Server) tlsConfig() *tls.Config {
	return s.cfg.TLSProfile.Server(&tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: s.cm.GetCertificate})
}

// review decodes an AdmissionReview, runs h and encodes its answer.
func (s *Server) review(path string, h AdmitFunc) http.Handler {
	return httperr.TextHandler(func(w http.ResponseWriter, r *http.Request) error {
		body, err := io.ReadAll(io.LimitReader(r.Body, 8<<20))
		if err != nil {
			return httperr.BadRequest("read body")
		}
		var ar admissionv1.AdmissionReview
		if err := json.Unmarshal(body, &ar); err != nil || ar.Request == nil {
			return httperr.BadRequest("not an admission review")
		}
		resp := h(r.Context(), ar.Request)
		if resp == nil {
			resp = &admissionv1.AdmissionResponse{Allowed: true}
		}
		resp.UID = ar.Request.UID
		if !resp.Allowed && resp.Result != nil {
			s.log.Info("denied", "path", path, "kind", ar.Request.Kind.Kind, "namespace", ar.Request.Namespace,
				"name", ar.Request.Name, "reason", resp.Result.Message)
		}
		out := admissionv1.AdmissionReview{TypeMeta: ar.TypeMeta, Response: resp}
		if out.APIVersion == "" {
			out.APIVersion, out.Kind = "admission.k8s.io/v1", "AdmissionReview"
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(&out)
		return nil
	})
}

// configurations renders the webhook configurations for bundle.
func (s *Server) configurations(bundle []byte) (*admissionregistrationv1.MutatingWebhookConfiguration, *admissionregistrationv1.ValidatingWebhookConfiguration) {
	s.mu.Lock()
	hooks := append([]Webhook(nil), s.webhooks...)
	target := s.target
	s.mu.Unlock()
	labels := map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}
	mut := &admissionregistrationv1.MutatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: MutatingConfigName, Labels: labels}}
	val := &admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: ValidatingConfigName, Labels: labels}}
	for _, h := range hooks {
		cc := target.ClientConfig(h.Path, bundle)
		fail := admissionregistrationv1.Fail
		if h.Ignore {
			fail = admissionregistrationv1.Ignore
		}
		side := admissionregistrationv1.SideEffectClassNone
		if h.SideEffects {
			side = admissionregistrationv1.SideEffectClassNoneOnDryRun
		}
		timeout := int32(10)
		if h.Timeout > 0 {
			timeout = int32(h.Timeout / time.Second)
		}
		equiv := admissionregistrationv1.Equivalent
		nsSel, objSel := h.NamespaceSelector, h.ObjectSelector
		if nsSel == nil {
			nsSel = &metav1.LabelSelector{}
		}
		if objSel == nil {
			objSel = &metav1.LabelSelector{}
		}
		if h.Mutating {
			never := admissionregistrationv1.NeverReinvocationPolicy
			mut.Webhooks = append(mut.Webhooks, admissionregistrationv1.MutatingWebhook{
				Name: h.Name, ClientConfig: cc, Rules: h.Rules, FailurePolicy: &fail, MatchPolicy: &equiv,
				NamespaceSelector: nsSel, ObjectSelector: objSel, SideEffects: &side, TimeoutSeconds: &timeout,
				AdmissionReviewVersions: []string{"v1"}, ReinvocationPolicy: &never, MatchConditions: h.MatchConditions,
			})
		} else {
			val.Webhooks = append(val.Webhooks, admissionregistrationv1.ValidatingWebhook{
				Name: h.Name, ClientConfig: cc, Rules: h.Rules, FailurePolicy: &fail, MatchPolicy: &equiv,
				NamespaceSelector: nsSel, ObjectSelector: objSel, SideEffects: &side, TimeoutSeconds: &timeout,
				AdmissionReviewVersions: []string{"v1"}, MatchConditions: h.MatchConditions,
			})
		}
	}
	return mut, val
}

// publish creates or updates both webhook configurations with bundle
// (first the Service and its EndpointSlice, with this brain in it, when
// they name a Service).
func (s *Server) publish(ctx context.Context, bundle []byte) error {
	if t := s.Target(); t.Service != nil {
		if err := aggregated.RegisterEndpoint(ctx, s.deps.Kube, *t.Service); err != nil {
			return fmt.Errorf("webhook service: %w", err)
		}
	}
	mut, val := s.configurations(bundle)
	ar := s.deps.Kube.AdmissionregistrationV1()
	if err := applyMutating(ctx, ar.MutatingWebhookConfigurations(), mut); err != nil {
		return fmt.Errorf("mutating webhook configuration: %w", err)
	}
	if err := applyValidating(ctx, ar.ValidatingWebhookConfigurations(), val); err != nil {
		return fmt.Errorf("validating webhook configuration: %w", err)
	}
	s.mu.Lock()
	target, hooks := s.target, append([]func(context.Context, Target, []byte) error(nil), s.onPub...)
	s.mu.Unlock()
	if target.zero() {
		return nil
	}
	for _, f := range hooks {
		if err := f(ctx, target, bundle); err != nil {
			return err
		}
	}
	return nil
}

// Contributor registers webhooks (and runners) of another role on the
// brain's server.
type Contributor func(s *Server) error

// NewRole builds the brain's webhook server with KubeVirt's own webhooks
// and those of contributors. Certificate lifetimes follow the
// HyperConverged kubevirt-hyperconverged's spec.certConfig in the namespace
// unless cfg.Certs.Durations is set.
func NewRole(cfg Config, deps Deps, contributors ...Contributor) (*Server, error) {
	if cfg.Certs.Durations == nil && deps.Virt != nil {
		cfg.Certs.Durations = certs.HCODurations(deps.Virt, cfg.Namespace, "kubevirt-hyperconverged")
	}
	s, err := New(cfg, deps)
	if err != nil {
		return nil, err
	}
	if err := RegisterKubeVirt(s); err != nil {
		return nil, err
	}
	for _, c := range contributors {
		if err := c(s); err != nil {
			return nil, err
		}
	}
	return s, nil
}
