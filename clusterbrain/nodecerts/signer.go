// Package nodecerts is the brain's node certificate signer: each nodeagent
// makes its key locally and asks for its certificate through a
// certificates.k8s.io/v1 CertificateSigningRequest with identity.NodeSignerName; the
// signer approves only requests whose requester is that node's own identity
// (user identity.NodeUser(node), group identity.NodesGroup or system:nodes) and whose content fits a
// (user identity.NodeUser(node), group identity.NodesGroup or system:nodes; or the
// node agents' ServiceAccount with a token bound to a pod on node) and whose content fits a
// node (its name, the names the brain's clients verify, the Node's
// addresses, TLS usages), signs them with the node CA that only the brain
// reads (uploadtls), and writes status.certificate: the leaf followed by the
// CA, so the node learns the CA it must trust for the brain's client
// certificates from the same answer. Anything else is denied with the
// reason.
package nodecerts

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"fmt"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"log/slog"
	"net"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
)

// KubernetesNodesGroup is Kubernetes' own nodes group; a requester in it
// (with the node's user name) is a node too.
const KubernetesNodesGroup = "system:nodes"

// AllowedUsages are the key usages a node certificate may have.
var AllowedUsages = []certificatesv1.KeyUsage{
	certificatesv1.UsageDigitalSignature, certificatesv1.UsageKeyEncipherment,
	certificatesv1.UsageServerAuth, certificatesv1.UsageClientAuth,
}

// Config configures a Signer.
type Config struct {
	Kube kubernetes.Interface
	// Namespace holds the node CA Secret (identity.UploadCASecretName).
	Namespace string
	// MaxDuration caps the lifetime of a certificate (default 7 days);
	// spec.expirationSeconds may ask for less.
	MaxDuration time.Duration
	Log         *slog.Logger
}

// Signer approves, denies and signs node certificate requests.
type Signer struct {
	cfg   Config
	log   *slog.Logger
	queue *controller.Queue
	csrs  cache.SharedIndexInformer
	ca    *uploadtls.CA
}

// New validates cfg.
func New(cfg Config) (*Signer, error) {
	if cfg.Kube == nil || cfg.Namespace == "" {
		return nil, errors.New("nodecerts: kube client and namespace are required")
	}
	if cfg.MaxDuration == 0 {
		cfg.MaxDuration = 7 * 24 * time.Hour
	}
	if cfg.MaxDuration < 10*time.Minute {
		return nil, errors.New("nodecerts: max duration must be at least 10 minutes (the API's minimum)")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	s := &Signer{cfg: cfg, log: cfg.Log.With("role", "node-certificates")}
	var err error
	s.queue, err = controller.New(controller.Config{Name: "node-certificates", Sync: controller.NoRequeue(s.sync),
		Backoff: controller.BackoffAPI, Log: s.log, KeyAttr: "csr"})
	if err != nil {
		return nil, err
	}
	factory := informers.NewSharedInformerFactoryWithOptions(cfg.Kube, 10*time.Minute,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.signerName", identity.NodeSignerName).String()
		}))
	s.csrs = factory.Certificates().V1().CertificateSigningRequests().Informer()
	if _, err := s.csrs.AddEventHandler(controller.OnAddOrUpdate(s.queue.Enqueue)); err != nil {
		return nil, err
	}
	return s, nil
}

// Name implements the daemon role.
func (s *Signer) Name() string { return "node-certificates" }

// Run loads the node CA (creating it when missing) and handles requests
// until ctx ends.
func (s *Signer) Run(ctx context.Context) error {
	defer s.queue.ShutDown()
	var err error
	if s.ca, err = uploadtls.EnsureCA(ctx, s.cfg.Kube, s.cfg.Namespace); err != nil {
		return fmt.Errorf("node ca: %w", err)
	}
	go s.csrs.RunWithContext(ctx)
	s.log.Info("signing node certificates", "signer", identity.NodeSignerName)
	if err := s.queue.Run(ctx, s.csrs.HasSynced); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

func hasCondition(csr *certificatesv1.CertificateSigningRequest, t certificatesv1.RequestConditionType) bool {
	return slices.ContainsFunc(csr.Status.Conditions, func(c certificatesv1.CertificateSigningRequestCondition) bool {
		return c.Type == t && c.Status == corev1.ConditionTrue
	})
}

func (s *Signer) sync(ctx context.Context, name string) error {
	obj, exists, err := s.csrs.GetIndexer().GetByKey(name)
	if err != nil || !exists {
		return err
	}
	csr := obj.(*certificatesv1.CertificateSigningRequest).DeepCopy()
	if csr.Spec.SignerName != identity.NodeSignerName || len(csr.Status.Certificate) > 0 ||
		hasCondition(csr, certificatesv1.CertificateDenied) || hasCondition(csr, certificatesv1.CertificateFailed) {
		return nil
	}
	api := s.cfg.Kube.CertificatesV1().CertificateSigningRequests()
	leaf, reason := s.review(ctx, csr)
	log := s.log.With("csr", csr.Name, "requester", csr.Spec.Username)
	if reason != "" {
		cond := certificatesv1.CertificateSigningRequestCondition{Type: certificatesv1.CertificateDenied,
			Status: corev1.ConditionTrue, Reason: "NodeRequestRejected", Message: reason, LastUpdateTime: metav1.Now()}
		if hasCondition(csr, certificatesv1.CertificateApproved) {
			// Approved by someone else, still not ours to sign.
			cond.Type, cond.Reason = certificatesv1.CertificateFailed, "SignerValidationFailure"
			csr.Status.Conditions = append(csr.Status.Conditions, cond)
			_, err = api.UpdateStatus(ctx, csr, metav1.UpdateOptions{})
		} else {
			csr.Status.Conditions = append(csr.Status.Conditions, cond)
			_, err = api.UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{})
		}
		if err == nil {
			log.Warn("node certificate request denied", "reason", reason)
		}
		return ignoreConflict(err)
	}
	if !hasCondition(csr, certificatesv1.CertificateApproved) {
		csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
			Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: "NodeIdentityMatches",
			Message: "requested by the node it names", LastUpdateTime: metav1.Now()})
		if csr, err = api.UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{}); err != nil {
			return ignoreConflict(err)
		}
	}
	cert, err := s.ca.Authority().Sign(leaf.Leaf, leaf.Public)
	if err != nil {
		return err
	}
	csr.Status.Certificate = append(certs.EncodeCertificate(cert.Raw), s.ca.CertPEM...)
	if _, err := api.UpdateStatus(ctx, csr, metav1.UpdateOptions{}); err != nil {
		return ignoreConflict(err)
	}
	log.Info("node certificate issued", "node", strings.TrimPrefix(cert.Subject.CommonName, identity.NodeUserPrefix),
		"notAfter", cert.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

// A conflict means a newer version is on its way through the informer.
func ignoreConflict(err error) error {
	if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

type signable struct {
	certs.Leaf
	Public any
}

// review checks csr against the node it names; reason is empty when it may
// be signed.
func (s *Signer) review(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) (signable, string) {
	req, err := certs.ParseCSR(csr.Spec.Request)
	if err != nil {
		return signable{}, err.Error()
	}
	node, ok := strings.CutPrefix(req.Subject.CommonName, identity.NodeUserPrefix)
	if !ok || node == "" {
		return signable{}, fmt.Sprintf("subject common name %q is not %s<node>", req.Subject.CommonName, identity.NodeUserPrefix)
	}
	if errs := validation.IsDNS1123Subdomain(node); len(errs) > 0 {
		return signable{}, fmt.Sprintf("node name %q: %s", node, strings.Join(errs, ", "))
	}
	extra := map[string][]string{}
	for k, v := range csr.Spec.Extra {
		extra[k] = v
	}
	// The node agents' ServiceAccount with a token bound to a pod on node
	// (rbac.NodeOf), else the node's own user.
	if requester, isNode := rbac.NodeOf(csr.Spec.Username, csr.Spec.Groups, extra); !isNode || requester != node {
		if csr.Spec.Username != identity.NodeUser(node) {
			return signable{}, fmt.Sprintf("requested by %q, not by node %s (%s, or a node agent token bound to a pod on it)",
				csr.Spec.Username, node, identity.NodeUser(node))
		}
		if !slices.Contains(csr.Spec.Groups, identity.NodesGroup) && !slices.Contains(csr.Spec.Groups, KubernetesNodesGroup) {
			return signable{}, fmt.Sprintf("requester is in neither group %s nor %s", identity.NodesGroup, KubernetesNodesGroup)
		}
	}
	if !slices.Equal(req.Subject.Organization, []string{identity.NodesGroup}) {
		return signable{}, fmt.Sprintf("subject organization %v, want [%s]", req.Subject.Organization, identity.NodesGroup)
	}
	if len(req.EmailAddresses) > 0 || len(req.URIs) > 0 {
		return signable{}, "email and URI names are not allowed"
	}
	if reason := keyAllowed(req); reason != "" {
		return signable{}, reason
	}
	leaf := certs.Leaf{CommonName: req.Subject.CommonName, Organization: req.Subject.Organization}
	for _, u := range csr.Spec.Usages {
		switch {
		case !slices.Contains(AllowedUsages, u):
			return signable{}, fmt.Sprintf("usage %q is not allowed", u)
		case u == certificatesv1.UsageServerAuth:
			leaf.Server = true
		case u == certificatesv1.UsageClientAuth:
			leaf.Client = true
		}
	}
	if !leaf.Server && !leaf.Client {
		return signable{}, "neither server auth nor client auth usage requested"
	}
	allowed := append([]string{node}, identity.NodeSharedNames...)
	for _, n := range req.DNSNames {
		if !slices.Contains(allowed, n) {
			return signable{}, fmt.Sprintf("dns name %q is not node %s's", n, node)
		}
	}
	if len(req.IPAddresses) > 0 {
		if reason := s.addressesOf(ctx, node, req.IPAddresses); reason != "" {
			return signable{}, reason
		}
	}
	leaf.DNSNames, leaf.IPs = req.DNSNames, req.IPAddresses
	leaf.Duration = s.cfg.MaxDuration
	if e := csr.Spec.ExpirationSeconds; e != nil && time.Duration(*e)*time.Second < leaf.Duration {
		leaf.Duration = time.Duration(*e) * time.Second
	}
	return signable{Leaf: leaf, Public: req.PublicKey}, ""
}

// addressesOf checks that every ip is an address of the Node.
func (s *Signer) addressesOf(ctx context.Context, node string, ips []net.IP) string {
	n, err := s.cfg.Kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return fmt.Sprintf("ip addresses requested but node %s unreadable: %v", node, err)
	}
	for _, ip := range ips {
		if !slices.ContainsFunc(n.Status.Addresses, func(a corev1.NodeAddress) bool {
			return (a.Type == corev1.NodeInternalIP || a.Type == corev1.NodeExternalIP) && net.ParseIP(a.Address).Equal(ip)
		}) {
			return fmt.Sprintf("ip %s is not an address of node %s", ip, node)
		}
	}
	return ""
}

func keyAllowed(req *x509.CertificateRequest) string {
	switch k := req.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if k.Curve == elliptic.P256() || k.Curve == elliptic.P384() {
			return ""
		}
	case *rsa.PublicKey:
		if k.N.BitLen() >= 2048 {
			return ""
		}
	}
	return fmt.Sprintf("key %T not allowed (ECDSA P-256/P-384 or RSA >= 2048 bits)", req.PublicKey)
}
