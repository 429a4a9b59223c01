// Package nodecert gets and renews a nodeagent's own certificate: the key
// is made on the node and never leaves it; the certificate is requested
// through a certificates.k8s.io/v1 CertificateSigningRequest for the
// brain's signer (clusterbrain/nodecerts), named system:node:<node> in
// group nodevirt:nodes. The answer carries the node CA after the leaf; the
// node trusts that CA for the brain's client certificates. Both are kept in
// a directory so a restarted agent serves at once, and handed to TLS
// servers through callbacks so a renewal needs no restart.
package nodecert

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// Files in Config.Dir.
const (
	KeyFile  = "node.key"
	CertFile = "node.crt" // leaf then CA, as the signer answered
)

// Config configures a Source.
type Config struct {
	Kube     kube.Interface
	NodeName string
	// Dir keeps the key and the certificate (0700, created when missing).
	Dir string
	// DNSNames are added to the node's name (default identity.NodeSharedNames).
	DNSNames []string
	// IPs are requested too; the signer allows only the Node's addresses.
	IPs []net.IP
	// Duration is the lifetime asked for (default 24h, at least 10 minutes).
	Duration time.Duration
	// RenewBefore renews that long before expiry (default: at two thirds of
	// the lifetime).
	RenewBefore time.Duration
	// Wait bounds one request's wait for the signer (default 2 minutes).
	Wait time.Duration
	// LibvirtDir, when set, also gets the key, the certificate and the node
	// CA in libvirt's TLS layout (see WriteLibvirtPKI), so libvirt daemons
	// authenticate each other with the node's certificate.
	LibvirtDir string
	// QEMUDir, when set with LibvirtDir, also gets them in QEMU's x509
	// layout (QEMU's native TLS for the migration stream), readable by
	// group QEMUGid, the group QEMU runs as.
	QEMUDir string
	QEMUGid int
	// OnWritten is called after each write of the libvirt files (the
	// stored certificate loaded, a new one issued); it must not block.
	OnWritten func()
	Log       *slog.Logger
}

func (c *Config) defaults() error {
	if c.Kube == nil || c.NodeName == "" || c.Dir == "" {
		return errors.New("nodecert: kube client, node name and directory are required")
	}
	if c.DNSNames == nil {
		c.DNSNames = identity.NodeSharedNames
	}
	if c.Duration == 0 {
		c.Duration = 24 * time.Hour
	}
	if c.Duration < 10*time.Minute {
		return errors.New("nodecert: duration must be at least 10 minutes")
	}
	if c.Wait == 0 {
		c.Wait = 2 * time.Minute
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	return nil
}

// issued is one certificate with its key and the CA that signed it.
type issued struct {
	tls  *tls.Certificate
	leaf *x509.Certificate
	ca   *x509.CertPool
	// caCert is the node CA, the last of the chain.
	caCert *x509.Certificate
}

// Source holds the node's current certificate.
type Source struct {
	cfg Config
	log *slog.Logger
	cur atomic.Pointer[issued]
}

// New validates cfg and loads the stored certificate, if any and valid.
func New(cfg Config) (*Source, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	s := &Source{cfg: cfg, log: cfg.Log.With("role", "node-certificate", "node", cfg.NodeName)}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("nodecert: %w", err)
	}
	if err := s.load(); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.log.Warn("stored node certificate unusable, requesting a new one", "err", err)
	}
	return s, nil
}

func (s *Source) load() error {
	certPEM, err := os.ReadFile(filepath.Join(s.cfg.Dir, CertFile))
	if err != nil {
		return err
	}
	keyPEM, err := os.ReadFile(filepath.Join(s.cfg.Dir, KeyFile))
	if err != nil {
		return err
	}
	is, err := parse(certPEM, keyPEM)
	if err != nil {
		return err
	}
	if !time.Now().Before(is.leaf.NotAfter) {
		return fmt.Errorf("stored certificate expired at %s", is.leaf.NotAfter)
	}
	if is.leaf.Subject.CommonName != identity.NodeUser(s.cfg.NodeName) {
		return fmt.Errorf("stored certificate is for %q", is.leaf.Subject.CommonName)
	}
	for _, ip := range s.cfg.IPs {
		if !slices.ContainsFunc(is.leaf.IPAddresses, ip.Equal) {
			return fmt.Errorf("stored certificate lacks address %s", ip)
		}
	}
	s.cur.Store(is)
	return s.writeLibvirt(is, keyPEM)
}

func parse(certPEM, keyPEM []byte) (*issued, error) {
	chain, err := certs.ParseCertificates(certPEM)
	if err != nil {
		return nil, err
	}
	if len(chain) < 2 {
		return nil, errors.New("certificate without its ca")
	}
	c, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, err
	}
	c.Leaf = chain[0]
	pool := x509.NewCertPool()
	pool.AddCert(chain[len(chain)-1])
	return &issued{tls: &c, leaf: chain[0], ca: pool, caCert: chain[len(chain)-1]}, nil
}

// Name implements the daemon role.
func (s *Source) Name() string { return "node-certificate" }

// Run requests a certificate when there is none or it is due, and again
// before each expiry, until ctx ends. Failed requests are retried.
func (s *Source) Run(ctx context.Context) error {
	retry := 2 * time.Second
	for {
		wait := time.Duration(0)
		if cur := s.cur.Load(); cur != nil {
			wait = time.Until(certs.RenewAt(cur.leaf, s.cfg.RenewBefore))
		}
		if wait > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(wait):
			}
		}
		if err := s.Request(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			s.log.Error("node certificate request failed", "err", err, "retry", retry)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(retry):
			}
			retry = min(retry*2, time.Minute)
			continue
		}
		retry = 2 * time.Second
	}
}

// Request makes a new key, asks the signer for its certificate, stores both
// and starts serving them.
func (s *Source) Request(ctx context.Context) error {
	key, err := certs.GenerateKey()
	if err != nil {
		return err
	}
	user := identity.NodeUser(s.cfg.NodeName)
	dns := append([]string{s.cfg.NodeName}, s.cfg.DNSNames...)
	req, err := certs.NewCSR(key, pkix.Name{CommonName: user, Organization: []string{identity.NodesGroup}}, dns, s.cfg.IPs)
	if err != nil {
		return err
	}
	secs := int32(s.cfg.Duration / time.Second)
	api := s.cfg.Kube.CertificatesV1().CertificateSigningRequests()
	csr, err := api.Create(ctx, &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "node-" + s.cfg.NodeName + "-",
			Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt", "nodevirt.io/node": s.cfg.NodeName}},
		Spec: certificatesv1.CertificateSigningRequestSpec{Request: req, SignerName: identity.NodeSignerName,
			ExpirationSeconds: &secs, Usages: []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature,
				certificatesv1.UsageKeyEncipherment, certificatesv1.UsageServerAuth, certificatesv1.UsageClientAuth}},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create certificate signing request: %w", err)
	}
	log := s.log.With("csr", csr.Name)
	log.Info("node certificate requested")
	certPEM, err := s.await(ctx, csr.Name)
	if err != nil {
		return fmt.Errorf("csr %s: %w", csr.Name, err)
	}
	keyPEM, err := certs.EncodeKey(key)
	if err != nil {
		return err
	}
	is, err := parse(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("csr %s: issued certificate: %w", csr.Name, err)
	}
	if is.leaf.Subject.CommonName != user {
		return fmt.Errorf("csr %s: issued for %q", csr.Name, is.leaf.Subject.CommonName)
	}
	if err := writeFile(filepath.Join(s.cfg.Dir, KeyFile), keyPEM); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(s.cfg.Dir, CertFile), certPEM); err != nil {
		return err
	}
	s.cur.Store(is)
	if err := s.writeLibvirt(is, keyPEM); err != nil {
		return err
	}
	log.Info("node certificate issued", "notAfter", is.leaf.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

// await polls the request until it is issued, denied or failed.
func (s *Source) await(ctx context.Context, name string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Wait)
	defer cancel()
	api := s.cfg.Kube.CertificatesV1().CertificateSigningRequests()
	tick := 200 * time.Millisecond
	for {
		csr, err := api.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, err
		}
		for _, c := range csr.Status.Conditions {
			if (c.Type == certificatesv1.CertificateDenied || c.Type == certificatesv1.CertificateFailed) && c.Status == corev1.ConditionTrue {
				return nil, fmt.Errorf("%s: %s: %s", c.Type, c.Reason, c.Message)
			}
		}
		if len(csr.Status.Certificate) > 0 {
			return csr.Status.Certificate, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("not signed within %s (is the brain running?): %w", s.cfg.Wait, ctx.Err())
		case <-time.After(tick):
		}
		tick = min(tick*2, 2*time.Second)
	}
}

func writeFile(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Ready reports whether a certificate is held.
func (s *Source) Ready() bool { return s.cur.Load() != nil }

// Leaf returns the current certificate, nil before the first.
func (s *Source) Leaf() *x509.Certificate {
	if cur := s.cur.Load(); cur != nil {
		return cur.leaf
	}
	return nil
}

var errNone = errors.New("no node certificate yet")

// GetCertificate serves the current certificate (tls.Config.GetCertificate).
func (s *Source) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	if cur := s.cur.Load(); cur != nil {
		return cur.tls, nil
	}
	return nil, errNone
}

// GetClientCertificate presents the current certificate as a client.
func (s *Source) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return s.GetCertificate(nil)
}

// ServerTLS is a server configuration that serves the current certificate
// and requires client certificates from the node CA of the current
// certificate; nextProtos are offered in ALPN.
func (s *Source) ServerTLS(nextProtos ...string) *tls.Config {
	base := &tls.Config{MinVersion: tls.VersionTLS12, ClientAuth: tls.RequireAndVerifyClientCert,
		NextProtos: slices.Clone(nextProtos)}
	base.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		cur := s.cur.Load()
		if cur == nil {
			return nil, errNone
		}
		return &tls.Config{MinVersion: tls.VersionTLS12, ClientAuth: tls.RequireAndVerifyClientCert,
			Certificates: []tls.Certificate{*cur.tls}, ClientCAs: cur.ca, NextProtos: base.NextProtos}, nil
	}
	return base
}

// PeerTLS is a client configuration for another node's endpoints: it
// presents the current certificate and trusts the node CA for the peer's;
// the caller sets ServerName to the peer's node name. It fails before the
// first certificate.
func (s *Source) PeerTLS(context.Context) (*tls.Config, error) {
	cur := s.cur.Load()
	if cur == nil {
		return nil, errNone
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*cur.tls}, RootCAs: cur.ca}, nil
}

// Files of libvirt's TLS layout: a client's pkipath directory
// (qemu+tls://host/system?pkipath=DIR) and, through libvirtd.conf's
// key_file, cert_file and ca_file, the server's.
const (
	LibvirtCAFile         = "cacert.pem"
	LibvirtClientCertFile = "clientcert.pem"
	LibvirtClientKeyFile  = "clientkey.pem"
	LibvirtServerCertFile = "servercert.pem"
	LibvirtServerKeyFile  = "serverkey.pem"
)

// WriteLibvirtPKI writes a node certificate (leaf first, its CA last, as the
// signer answers) and its key into dir in libvirt's TLS layout: the node CA
// as the only CA trusted, the one certificate and key as both client and
// server credentials. libvirt then admits a peer only with a certificate of
// the node CA, and its client checks the server's certificate against the
// host of the URI (the target node's address).
func WriteLibvirtPKI(dir string, certPEM, keyPEM []byte) error {
	is, err := parse(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("libvirt pki: %w", err)
	}
	return writeLibvirtPKI(dir, is, keyPEM)
}

// WriteQEMUPKI writes a node certificate (leaf first, its CA last) and its
// key into dir in QEMU's x509 layout, readable by group gid, as the agent
// does for --qemu-tls-dir.
func WriteQEMUPKI(dir string, gid int, certPEM, keyPEM []byte) error {
	is, err := parse(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("qemu pki: %w", err)
	}
	return writeQEMUPKI(dir, gid, is, keyPEM)
}

func (s *Source) writeLibvirt(is *issued, keyPEM []byte) error {
	if s.cfg.LibvirtDir == "" {
		return nil
	}
	if err := writeLibvirtPKI(s.cfg.LibvirtDir, is, keyPEM); err != nil {
		return err
	}
	if s.cfg.QEMUDir != "" {
		if err := writeQEMUPKI(s.cfg.QEMUDir, s.cfg.QEMUGid, is, keyPEM); err != nil {
			return err
		}
	}
	if s.cfg.OnWritten != nil {
		s.cfg.OnWritten()
	}
	return nil
}

// Files of QEMU's x509 directory (qemu.conf migrate_tls_x509_cert_dir).
const (
	QEMUCAFile         = "ca-cert.pem"
	QEMUServerCertFile = "server-cert.pem"
	QEMUServerKeyFile  = "server-key.pem"
	QEMUClientCertFile = "client-cert.pem"
	QEMUClientKeyFile  = "client-key.pem"
)

// writeQEMUPKI writes the certificate in QEMU's x509 layout into dir: the
// node CA, and the one certificate and key as server and client
// credentials; dir and files belong to group gid (QEMU's), which may read
// them and nothing else.
func writeQEMUPKI(dir string, gid int, is *issued, keyPEM []byte) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("qemu pki: %w", err)
	}
	if err := os.Chown(dir, 0, gid); err != nil {
		return fmt.Errorf("qemu pki: %w", err)
	}
	if err := os.Chmod(dir, 0o750); err != nil {
		return fmt.Errorf("qemu pki: %w", err)
	}
	leaf := certs.EncodeCertificate(is.leaf.Raw)
	for name, data := range map[string][]byte{
		QEMUCAFile: certs.EncodeCertificate(is.caCert.Raw), QEMUServerCertFile: leaf, QEMUClientCertFile: leaf,
		QEMUServerKeyFile: keyPEM, QEMUClientKeyFile: keyPEM,
	} {
		path := filepath.Join(dir, name)
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, data, 0o640); err != nil {
			return fmt.Errorf("qemu pki: %w", err)
		}
		if err := os.Chown(tmp, 0, gid); err != nil {
			return fmt.Errorf("qemu pki: %w", err)
		}
		if err := os.Chmod(tmp, 0o640); err != nil {
			return fmt.Errorf("qemu pki: %w", err)
		}
		if err := os.Rename(tmp, path); err != nil {
			return fmt.Errorf("qemu pki: %w", err)
		}
	}
	return nil
}

func writeLibvirtPKI(dir string, is *issued, keyPEM []byte) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("libvirt pki: %w", err)
	}
	// The leaf alone: libvirt checks the first certificate of the file
	// against the CA file.
	leaf := certs.EncodeCertificate(is.leaf.Raw)
	files := []struct {
		name string
		data []byte
	}{
		{LibvirtCAFile, certs.EncodeCertificate(is.caCert.Raw)},
		{LibvirtClientKeyFile, keyPEM}, {LibvirtServerKeyFile, keyPEM},
		{LibvirtClientCertFile, leaf}, {LibvirtServerCertFile, leaf},
	}
	for _, f := range files {
		if err := writeFile(filepath.Join(dir, f.name), f.data); err != nil {
			return fmt.Errorf("libvirt pki: %w", err)
		}
	}
	return nil
}
