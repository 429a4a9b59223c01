// Package uploadtls holds the node CA: one CA, kept in a Secret in the
// brain's namespace that only the brain reads, from which the brain mints
// the serving certificates of its upload API and upload proxy and its
// client certificates towards the nodes, and signs each nodeagent's own
// certificate (requested by CSR, see clusterbrain/nodecerts). The brain and
// the nodeagents trust only this CA for each other (mutual TLS).
package uploadtls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
)

// The CA's Secret and the names of the certificates it issues are part of
// the contract between the daemons: identity.UploadCASecretName,
// identity.UploadProxyClientName, identity.UploadServerName.

const (
	caValidity   = 10 * 365 * 24 * time.Hour
	leafValidity = 365 * 24 * time.Hour
)

// CA is the upload certificate authority (the node CA): it signs the
// brain's upload and subresource certificates and, through the brain's
// node certificate signer, the nodes' certificates.
type CA struct {
	Cert    *x509.Certificate
	CertPEM []byte
	ca      *certs.CA
}

// EnsureCA returns the CA stored in namespace, creating it when missing
// (several brains racing end up with the one stored first).
func EnsureCA(ctx context.Context, kube kubernetes.Interface, namespace string) (*CA, error) {
	ca, err := LoadCA(ctx, kube, namespace)
	if err == nil || !apierrors.IsNotFound(err) {
		return ca, err
	}
	fresh, err := certs.CreateCA("nodevirt-upload-ca", caValidity, time.Now())
	if err != nil {
		return nil, err
	}
	kp, err := fresh.KeyPair()
	if err != nil {
		return nil, err
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: identity.UploadCASecretName, Namespace: namespace,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
		Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: kp.CertPEM, corev1.TLSPrivateKeyKey: kp.KeyPEM},
	}
	_, err = kube.CoreV1().Secrets(namespace).Create(ctx, secret, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create secret %s/%s: %w", namespace, identity.UploadCASecretName, err)
	}
	return LoadCA(ctx, kube, namespace)
}

// LoadCA reads the CA stored in namespace; the error is a NotFound API
// error while the brain has not created it. Only the brain may read it.
func LoadCA(ctx context.Context, kube kubernetes.Interface, namespace string) (*CA, error) {
	s, err := kube.CoreV1().Secrets(namespace).Get(ctx, identity.UploadCASecretName, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return ParseCA(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
}

// ParseCA builds a CA from PEM data.
func ParseCA(certPEM, keyPEM []byte) (*CA, error) {
	ca, err := certs.ParseCA(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("upload %w", err)
	}
	return &CA{Cert: ca.Cert, CertPEM: ca.CertPEM, ca: ca}, nil
}

// Authority is the CA as the PKI package's signer.
func (ca *CA) Authority() *certs.CA { return ca.ca }

// Pool is a pool holding only the CA.
func (ca *CA) Pool() *x509.CertPool { return ca.ca.Pool() }

// Issue mints a leaf certificate for commonName: a client certificate when
// client is set, else a serving certificate for dnsNames and ips.
func (ca *CA) Issue(commonName string, dnsNames []string, ips []net.IP, client bool) (tls.Certificate, error) {
	c, err := ca.ca.IssueTLS(certs.Leaf{CommonName: commonName, DNSNames: dnsNames, IPs: ips,
		Server: !client, Client: client, Duration: leafValidity})
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("issue %s: %w", commonName, err)
	}
	return c, nil
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
