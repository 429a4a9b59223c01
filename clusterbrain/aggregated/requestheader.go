// Package aggregated is what an aggregated API server of the brain needs
// around its handlers: it trusts only requests that kube-apiserver's
// aggregator proxied (client certificate signed by the front-proxy CA, user
// in X-Remote-* headers, as published in kube-system's
// extension-apiserver-authentication ConfigMap), asks kube-apiserver whether
// that user may do what the request asks (SubjectAccessReview), and
// registers the API (Service, EndpointSlice, APIService with the
// serving CA bundle) so kube-apiserver routes the group to this process.
package aggregated

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// AuthConfigMap is where kube-apiserver publishes how extension API servers
// must authenticate its proxied requests.
const (
	AuthConfigMapNamespace = "kube-system"
	AuthConfigMapName      = "extension-apiserver-authentication"
)

// User is the caller as the aggregator authenticated it.
type User struct {
	Name   string
	UID    string
	Groups []string
	Extra  map[string][]string
}

// ErrUnauthenticated is returned for requests that did not come through the
// aggregator (no client certificate, wrong CA, name not allowed, no user).
var ErrUnauthenticated = errors.New("request not authenticated by the aggregator")

// RequestHeader verifies proxied requests and extracts their user.
type RequestHeader struct {
	mu            sync.RWMutex
	pool          *x509.CertPool
	allowedNames  []string
	userHeaders   []string
	uidHeaders    []string
	groupHeaders  []string
	extraPrefixes []string
}

// LoadRequestHeader reads the extension-apiserver-authentication ConfigMap.
func LoadRequestHeader(ctx context.Context, kube kubernetes.Interface) (*RequestHeader, error) {
	rh := &RequestHeader{}
	if err := rh.Reload(ctx, kube); err != nil {
		return nil, err
	}
	return rh, nil
}

// Reload rereads the ConfigMap (the front-proxy CA may rotate).
func (rh *RequestHeader) Reload(ctx context.Context, kube kubernetes.Interface) error {
	cm, err := kube.CoreV1().ConfigMaps(AuthConfigMapNamespace).Get(ctx, AuthConfigMapName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read %s/%s: %w", AuthConfigMapNamespace, AuthConfigMapName, err)
	}
	caPEM := cm.Data["requestheader-client-ca-file"]
	if caPEM == "" {
		return fmt.Errorf("%s has no requestheader-client-ca-file: kube-apiserver runs without the aggregation layer", AuthConfigMapName)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM([]byte(caPEM)) {
		return errors.New("requestheader-client-ca-file holds no certificate")
	}
	list := func(key string, def ...string) ([]string, error) {
		raw := cm.Data[key]
		if raw == "" {
			return def, nil
		}
		var v []string
		if err := json.Unmarshal([]byte(raw), &v); err != nil {
			return nil, fmt.Errorf("%s: %w", key, err)
		}
		return v, nil
	}
	var errs []error
	names, err := list("requestheader-allowed-names")
	errs = append(errs, err)
	users, err := list("requestheader-username-headers", "X-Remote-User")
	errs = append(errs, err)
	uids, err := list("requestheader-uid-headers")
	errs = append(errs, err)
	groups, err := list("requestheader-group-headers", "X-Remote-Group")
	errs = append(errs, err)
	extras, err := list("requestheader-extra-headers-prefix", "X-Remote-Extra-")
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return err
	}
	rh.mu.Lock()
	defer rh.mu.Unlock()
	rh.pool, rh.allowedNames = pool, names
	rh.userHeaders, rh.uidHeaders, rh.groupHeaders, rh.extraPrefixes = users, uids, groups, extras
	return nil
}

// Run rereads the ConfigMap every interval until ctx ends.
func (rh *RequestHeader) Run(ctx context.Context, kube kubernetes.Interface, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_ = rh.Reload(ctx, kube) // keep the last good configuration
		}
	}
}

// Authenticate returns the user of a request proxied by the aggregator.
func (rh *RequestHeader) Authenticate(r *http.Request) (User, error) {
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		return User{}, fmt.Errorf("%w: no client certificate", ErrUnauthenticated)
	}
	rh.mu.RLock()
	defer rh.mu.RUnlock()
	leaf := r.TLS.PeerCertificates[0]
	inter := x509.NewCertPool()
	for _, c := range r.TLS.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: rh.pool, Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return User{}, fmt.Errorf("%w: %v", ErrUnauthenticated, err)
	}
	if len(rh.allowedNames) > 0 && !slices.Contains(rh.allowedNames, leaf.Subject.CommonName) {
		return User{}, fmt.Errorf("%w: client %q is not an allowed proxy", ErrUnauthenticated, leaf.Subject.CommonName)
	}
	u := User{Extra: map[string][]string{}}
	for _, h := range rh.userHeaders {
		if v := r.Header.Get(h); v != "" {
			u.Name = v
			break
		}
	}
	if u.Name == "" {
		return User{}, fmt.Errorf("%w: no user header", ErrUnauthenticated)
	}
	for _, h := range rh.uidHeaders {
		if v := r.Header.Get(h); v != "" {
			u.UID = v
			break
		}
	}
	for _, h := range rh.groupHeaders {
		u.Groups = append(u.Groups, r.Header.Values(h)...)
	}
	for key, vals := range r.Header {
		for _, p := range rh.extraPrefixes {
			if len(key) > len(p) && strings.EqualFold(key[:len(p)], p) {
				name := strings.ToLower(key[len(p):])
				if un, err := url.PathUnescape(name); err == nil {
					name = un
				}
				u.Extra[name] = append(u.Extra[name], vals...)
			}
		}
	}
	return u, nil
}

type userKey struct{}

// WithUser returns ctx carrying u.
func WithUser(ctx context.Context, u User) context.Context {
	return context.WithValue(ctx, userKey{}, u)
}

// UserFrom returns the authenticated user a Server put into ctx.
func UserFrom(ctx context.Context) (User, bool) {
	u, ok := ctx.Value(userKey{}).(User)
	return u, ok
}
