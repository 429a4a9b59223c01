package controlplane

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
)

// CA is a certificate authority kept as PEM files in a directory; a thin
// wrapper of the project's PKI package (clusterbrain/kit/certs) for the control
// plane's identities.
type CA struct {
	Cert    *x509.Certificate
	Key     crypto.Signer
	CertPEM []byte
	ca      *certs.CA
}

// CertRequest describes a certificate signed by a CA.
type CertRequest struct {
	CommonName   string
	Organization []string
	DNSNames     []string
	IPs          []net.IP
	Server       bool
	Client       bool
	Validity     time.Duration
}

func wrap(ca *certs.CA) *CA { return &CA{Cert: ca.Cert, Key: ca.Key, CertPEM: ca.CertPEM, ca: ca} }

// NewCA creates a self-signed CA valid for validity.
func NewCA(name string, validity time.Duration) (*CA, error) {
	ca, err := certs.CreateCA(name, validity, time.Now())
	if err != nil {
		return nil, err
	}
	return wrap(ca), nil
}

// LoadCA reads a CA written by WriteFiles.
func LoadCA(certFile, keyFile string) (*CA, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, err
	}
	ca, err := certs.ParseCA(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load ca %s: %w", certFile, err)
	}
	return wrap(ca), nil
}

// Sign issues a certificate and returns its PEM and its key's PEM.
func (ca *CA) Sign(req CertRequest) (certPEM, keyPEM []byte, err error) {
	kp, err := ca.ca.Issue(certs.Leaf{CommonName: req.CommonName, Organization: req.Organization,
		DNSNames: req.DNSNames, IPs: req.IPs, Server: req.Server, Client: req.Client, Duration: req.Validity})
	if err != nil {
		return nil, nil, err
	}
	return kp.CertPEM, kp.KeyPEM, nil
}

// KeyPEM returns the CA key as PEM.
func (ca *CA) KeyPEM() []byte {
	kp, err := ca.ca.KeyPair()
	if err != nil {
		panic(err) // a key this package generated or parsed always encodes
	}
	return kp.KeyPEM
}

// pki is the set of files the control plane needs, all under one directory.
type pki struct {
	dir string
}

func (p pki) path(name string) string { return filepath.Join(p.dir, name) }

// generate writes every certificate and key unless they already exist, so a
// restarted lab keeps its identities and kubeconfigs stay valid.
func (p pki) generate() error {
	if _, err := os.Stat(p.path("ca.crt")); err == nil {
		return nil
	}
	if err := os.MkdirAll(p.dir, 0o700); err != nil {
		return err
	}
	ca, err := NewCA("nodevirt-cluster-ca", 10*365*24*time.Hour)
	if err != nil {
		return err
	}
	frontCA, err := NewCA("nodevirt-front-proxy-ca", 10*365*24*time.Hour)
	if err != nil {
		return err
	}
	files := map[string][]byte{
		"ca.crt":             ca.CertPEM,
		"ca.key":             ca.KeyPEM(),
		"front-proxy-ca.crt": frontCA.CertPEM,
		"front-proxy-ca.key": frontCA.KeyPEM(),
	}
	issue := func(name string, signer *CA, req CertRequest) error {
		c, k, err := signer.Sign(req)
		if err != nil {
			return err
		}
		files[name+".crt"], files[name+".key"] = c, k
		return nil
	}
	steps := []struct {
		name   string
		signer *CA
		req    CertRequest
	}{
		{"apiserver", ca, CertRequest{CommonName: "kube-apiserver", Server: true,
			DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
			IPs:      []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.0.0.1")}}},
		{"front-proxy-client", frontCA, CertRequest{CommonName: "front-proxy-client", Client: true}},
		{"admin", ca, CertRequest{CommonName: "nodevirt-admin", Organization: []string{"system:masters"}, Client: true}},
		{"controller-manager", ca, CertRequest{CommonName: "system:kube-controller-manager", Client: true}},
	}
	for _, s := range steps {
		if err := issue(s.name, s.signer, s.req); err != nil {
			return err
		}
	}
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return fmt.Errorf("generate service-account key: %w", err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return err
	}
	files["sa.key"] = pem.EncodeToMemory(&pem.Block{Type: certs.BlockRSAKey, Bytes: x509.MarshalPKCS1PrivateKey(saKey)})
	files["sa.pub"] = pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub})
	for name, data := range files {
		if err := os.WriteFile(p.path(name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}
