package controlplane

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// CA is a certificate authority kept as PEM files in a directory.
type CA struct {
	Cert    *x509.Certificate
	Key     *ecdsa.PrivateKey
	CertPEM []byte
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

// NewCA creates a self-signed CA valid for validity.
func NewCA(name string, validity time.Duration) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate ca key: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("sign ca %s: %w", name, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, CertPEM: pemBlock("CERTIFICATE", der)}, nil
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
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, fmt.Errorf("load ca %s: no pem data", certFile)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("load ca %s: %w", certFile, err)
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("load ca key %s: %w", keyFile, err)
	}
	return &CA{Cert: cert, Key: key, CertPEM: certPEM}, nil
}

// Sign issues a certificate and returns its PEM and its key's PEM.
func (ca *CA) Sign(req CertRequest) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate key for %s: %w", req.CommonName, err)
	}
	validity := req.Validity
	if validity == 0 {
		validity = 365 * 24 * time.Hour
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: req.CommonName, Organization: req.Organization},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(validity),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		DNSNames:     req.DNSNames,
		IPAddresses:  req.IPs,
	}
	if req.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if req.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return nil, nil, fmt.Errorf("sign %s: %w", req.CommonName, err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pemBlock("CERTIFICATE", der), pemBlock("EC PRIVATE KEY", kder), nil
}

// KeyPEM returns the CA key as PEM.
func (ca *CA) KeyPEM() []byte {
	der, err := x509.MarshalECPrivateKey(ca.Key)
	if err != nil {
		panic(err) // a P-256 key always marshals
	}
	return pemBlock("EC PRIVATE KEY", der)
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
	files["sa.key"] = pemBlock("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(saKey))
	files["sa.pub"] = pemBlock("PUBLIC KEY", pub)
	for name, data := range files {
		if err := os.WriteFile(p.path(name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return n
}
