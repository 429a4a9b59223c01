// Package uploadtls holds the small certificate authority of uploads: one
// CA, kept in a Secret in the brain's namespace, from which the brain mints
// the serving certificates of its upload API and upload proxy and its
// client certificate, and each nodeagent mints the serving certificate of
// its upload endpoint. The proxy and the nodeagents trust only this CA for
// each other (mutual TLS).
package uploadtls

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

const (
	// CASecretName is the Secret (type kubernetes.io/tls) holding the CA.
	CASecretName = "nodevirt-upload-ca"
	// ProxyClientName is the common name of the upload proxy's client
	// certificate; nodeagents accept no other.
	ProxyClientName = "nodevirt-upload-proxy"
	// NodeServerName is the DNS name every nodeagent's upload certificate
	// carries and the proxy verifies.
	NodeServerName = "nodevirt-dvimport"

	caValidity   = 10 * 365 * 24 * time.Hour
	leafValidity = 365 * 24 * time.Hour
)

// CA is the upload certificate authority.
type CA struct {
	Cert    *x509.Certificate
	CertPEM []byte
	key     crypto.Signer
}

// EnsureCA returns the CA stored in namespace, creating it when missing
// (several brains racing end up with the one stored first).
func EnsureCA(ctx context.Context, kube kubernetes.Interface, namespace string) (*CA, error) {
	ca, err := LoadCA(ctx, kube, namespace)
	if err == nil || !apierrors.IsNotFound(err) {
		return ca, err
	}
	certPEM, keyPEM, err := newCA()
	if err != nil {
		return nil, err
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: CASecretName, Namespace: namespace,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
		Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: certPEM, corev1.TLSPrivateKeyKey: keyPEM},
	}
	_, err = kube.CoreV1().Secrets(namespace).Create(ctx, secret, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create secret %s/%s: %w", namespace, CASecretName, err)
	}
	return LoadCA(ctx, kube, namespace)
}

// LoadCA reads the CA stored in namespace; the error is a NotFound API
// error while the brain has not created it.
func LoadCA(ctx context.Context, kube kubernetes.Interface, namespace string) (*CA, error) {
	s, err := kube.CoreV1().Secrets(namespace).Get(ctx, CASecretName, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return ParseCA(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
}

// ParseCA builds a CA from PEM data.
func ParseCA(certPEM, keyPEM []byte) (*CA, error) {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("upload ca: %w", err)
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("upload ca: %w", err)
	}
	key, ok := pair.PrivateKey.(crypto.Signer)
	if !ok || !cert.IsCA {
		return nil, errors.New("upload ca: not a certificate authority")
	}
	return &CA{Cert: cert, CertPEM: certPEM, key: key}, nil
}

// Pool is a pool holding only the CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Issue mints a leaf certificate for commonName: a client certificate when
// client is set, else a serving certificate for dnsNames and ips.
func (ca *CA) Issue(commonName string, dnsNames []string, ips []net.IP, client bool) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: commonName},
		NotBefore:    now.Add(-5 * time.Minute),
		NotAfter:     now.Add(leafValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     dnsNames,
		IPAddresses:  ips,
	}
	if client {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("issue %s: %w", commonName, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der, ca.Cert.Raw}, PrivateKey: key, Leaf: leaf}, nil
}

func newCA() (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "nodevirt-upload-ca"},
		NotBefore:             now.Add(-5 * time.Minute),
		NotAfter:              now.Add(caValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		panic(err) // the system's random source failed
	}
	return n
}

// HostIP returns the first global unicast IPv4 address of this host, the
// address the brain and the nodeagents advertise when told none: the API
// server rejects loopback addresses in endpoints.
func HostIP() (net.IP, error) {
	ifaces, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	for _, ifc := range ifaces {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
				return n.IP.To4(), nil
			}
		}
	}
	return nil, errors.New("no global unicast ipv4 address on this host")
}
