// Package kube is the node agent's narrow view of the Kubernetes API: the
// typed clients of the four API groups the node roles use (core,
// coordination, certificates, storage), built from one rest.Config over one
// HTTP client, and shared informers for the kinds several roles watch
// (claims, volumes, storage classes).
//
// The full client-go clientset (every API group, each with its apply
// configurations) and its informer factory (an informer per kind of every
// group) are large; a node daemon that links them pays for their code in
// resident memory on every node. Everything here is a subset of them:
// a *kubernetes.Clientset satisfies Interface, so tests and callers that
// hold one pass it unchanged.
package kube

import (
	"fmt"
	"net/http"

	"k8s.io/client-go/kubernetes"
	certificatesv1 "k8s.io/client-go/kubernetes/typed/certificates/v1"
	coordinationv1 "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	storagev1 "k8s.io/client-go/kubernetes/typed/storage/v1"
	"k8s.io/client-go/rest"
)

// Interface is what the node roles call on the Kubernetes API.
type Interface interface {
	CoreV1() corev1.CoreV1Interface
	CoordinationV1() coordinationv1.CoordinationV1Interface
	CertificatesV1() certificatesv1.CertificatesV1Interface
	StorageV1() storagev1.StorageV1Interface
}

var (
	_ Interface = (*Clientset)(nil)
	// The full clientset is a superset: whoever holds one passes it.
	_ Interface = (kubernetes.Interface)(nil)
)

// Clientset holds the typed clients of Interface.
type Clientset struct {
	core         *corev1.CoreV1Client
	coordination *coordinationv1.CoordinationV1Client
	certificates *certificatesv1.CertificatesV1Client
	storage      *storagev1.StorageV1Client
}

// NewForConfig builds the clients from rc, sharing one HTTP client (one
// connection pool, one rate limiter per group as client-go does).
func NewForConfig(rc *rest.Config) (*Clientset, error) {
	c := *rc
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	hc, err := rest.HTTPClientFor(&c)
	if err != nil {
		return nil, fmt.Errorf("kubernetes http client: %w", err)
	}
	return newForConfigAndClient(&c, hc)
}

func newForConfigAndClient(c *rest.Config, hc *http.Client) (*Clientset, error) {
	var cs Clientset
	var err error
	if cs.core, err = corev1.NewForConfigAndClient(c, hc); err != nil {
		return nil, fmt.Errorf("core/v1 client: %w", err)
	}
	if cs.coordination, err = coordinationv1.NewForConfigAndClient(c, hc); err != nil {
		return nil, fmt.Errorf("coordination/v1 client: %w", err)
	}
	if cs.certificates, err = certificatesv1.NewForConfigAndClient(c, hc); err != nil {
		return nil, fmt.Errorf("certificates/v1 client: %w", err)
	}
	if cs.storage, err = storagev1.NewForConfigAndClient(c, hc); err != nil {
		return nil, fmt.Errorf("storage/v1 client: %w", err)
	}
	return &cs, nil
}

// CoreV1 is the core/v1 client.
func (c *Clientset) CoreV1() corev1.CoreV1Interface { return c.core }

// CoordinationV1 is the coordination.k8s.io/v1 client.
func (c *Clientset) CoordinationV1() coordinationv1.CoordinationV1Interface { return c.coordination }

// CertificatesV1 is the certificates.k8s.io/v1 client.
func (c *Clientset) CertificatesV1() certificatesv1.CertificatesV1Interface { return c.certificates }

// StorageV1 is the storage.k8s.io/v1 client.
func (c *Clientset) StorageV1() storagev1.StorageV1Interface { return c.storage }
