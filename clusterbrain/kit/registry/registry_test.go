package registry

import (
	"context"
	"encoding/pem"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry/registrytest"
)

// loopback lets the tests reach their own servers, which the reach policy
// forbids by default.
var loopback = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}

func wantKind(t *testing.T, err error, want Kind) {
	t.Helper()
	var re *Error
	if !errors.As(err, &re) {
		t.Fatalf("error %v (%T) is no *registry.Error", err, err)
	}
	if re.Kind != want {
		t.Errorf("kind %d (%v), want %d", re.Kind, err, want)
	}
}

func TestParseURL(t *testing.T) {
	for _, c := range []struct{ url, host, repo, ref string }{
		{"docker://quay.io/containerdisks/fedora:41", "quay.io", "containerdisks/fedora", "41"},
		{"docker://quay.io/containerdisks/fedora", "quay.io", "containerdisks/fedora", "latest"},
		{"docker://localhost:5000/a/b:c", "localhost:5000", "a/b", "c"},
		{"docker://localhost:5000/a/b", "localhost:5000", "a/b", "latest"},
		{"docker://r.example/a@sha256:abc", "r.example", "a", "sha256:abc"},
	} {
		host, repo, ref, err := ParseURL(c.url)
		if err != nil || host != c.host || repo != c.repo || ref != c.ref {
			t.Errorf("%s: %q %q %q %v, want %q %q %q", c.url, host, repo, ref, err, c.host, c.repo, c.ref)
		}
	}
	for _, bad := range []string{"https://quay.io/a", "docker://quay.io", "docker:///a", "docker://quay.io/"} {
		_, _, _, err := ParseURL(bad)
		wantKind(t, err, KindInvalidSource)
	}
}

func TestParseAuthParams(t *testing.T) {
	got := parseAuthParams(`realm="https://auth.example/token",service="registry.example", scope="repository:a/b:pull,push",x=y`)
	want := map[string]string{"realm": "https://auth.example/token", "service": "registry.example", "scope": "repository:a/b:pull,push", "x": "y"}
	if len(got) != len(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
}

// TestPull: a tag resolves to its manifest's digest, its layers are found,
// and a blob's bytes hash to their digest; basic auth, unknown tags, wrong
// credentials and registries not declared insecure fail with their kind.
func TestPull(t *testing.T) {
	reg := registrytest.New()
	reg.SetAuth("puller", "pw")
	host, stop := reg.Serve()
	defer stop()
	manifest, layer, err := reg.Publish("os/fedora", "41", map[string][]byte{"disk/disk.img": []byte("disk bytes")})
	if err != nil {
		t.Fatal(err)
	}
	src := Source{URL: "docker://" + host + "/os/fedora:41", Username: "puller", Password: "pw",
		InsecureRegistries: []string{host}, AllowedNetworks: loopback}
	ctx := context.Background()

	digest, err := ResolveDigest(ctx, src)
	if err != nil || digest != manifest {
		t.Fatalf("digest %q, %v; want %s", digest, err, manifest)
	}
	pinned := src
	pinned.URL = "docker://" + host + "/os/fedora@" + manifest
	c, err := New(ctx, pinned)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if d, err := c.Digest(ctx); err != nil || d != manifest {
		t.Errorf("pinned digest %q, %v", d, err)
	}
	layers, err := c.Layers(ctx)
	if err != nil || len(layers) != 1 || layers[0].Digest != layer {
		t.Fatalf("layers %+v, %v; want one %s", layers, err, layer)
	}
	body, err := c.Blob(ctx, layers[0])
	if err != nil {
		t.Fatal(err)
	}
	h, want, err := DigestHash(layer)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(h, body)
	body.Close()
	if string(h.Sum(nil)) != string(want) {
		t.Errorf("blob does not hash to %s", layer)
	}

	for name, c := range map[string]struct {
		mod  func(*Source)
		kind Kind
	}{
		"unknown tag":              {func(s *Source) { s.URL = "docker://" + host + "/os/fedora:40" }, KindNotFound},
		"wrong password":           {func(s *Source) { s.Password = "nope" }, KindUnauthorized},
		"no credentials":           {func(s *Source) { s.Username, s.Password = "", "" }, KindUnauthorized},
		"plain http, not insecure": {func(s *Source) { s.InsecureRegistries = nil }, KindUnreachable},
		"bad ca bundle":            {func(s *Source) { s.CACertPEM = []byte("not pem") }, KindInvalidSource},
		"bad url":                  {func(s *Source) { s.URL = "https://" + host + "/os/fedora" }, KindInvalidSource},
	} {
		t.Run(name, func(t *testing.T) {
			s := src
			c.mod(&s)
			_, err := ResolveDigest(ctx, s)
			wantKind(t, err, c.kind)
		})
	}
	if _, _, err := DigestHash("md5:00"); err == nil {
		t.Error("md5 digest accepted")
	}
}

// TestReachPolicyApplies: without an allowance a loopback registry is
// never contacted, and the refusal is recognisable.
func TestReachPolicyApplies(t *testing.T) {
	var hits atomic.Int32
	reg := registrytest.New()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		reg.ServeHTTP(w, r)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	_, err := ResolveDigest(context.Background(), Source{URL: "docker://" + host + "/a/b:c", InsecureRegistries: []string{host}})
	wantKind(t, err, KindUnreachable)
	if !reach.IsNotAllowed(err) {
		t.Errorf("%v: no *reach.NotAllowedError in the chain", err)
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("the registry got %d requests", n)
	}
}

// TestBearerTokenOverTLS: a registry behind TLS (trusted through the CA
// bundle) that answers with a bearer challenge; the token endpoint wants
// the credentials and gets the pull scope of the repository.
func TestBearerTokenOverTLS(t *testing.T) {
	reg := registrytest.New()
	manifest, _, err := reg.Publish("os/fedora", "41", map[string][]byte{"disk/disk.img": []byte("x")})
	if err != nil {
		t.Fatal(err)
	}
	var scope atomic.Value
	var srv *httptest.Server
	srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/token" {
			if u, p, _ := r.BasicAuth(); u != "puller" || p != "pw" {
				http.Error(w, "bad credentials", http.StatusUnauthorized)
				return
			}
			scope.Store(r.URL.Query().Get("scope") + " " + r.URL.Query().Get("service"))
			w.Write([]byte(`{"access_token":"tok-1"}`))
			return
		}
		if r.Header.Get("Authorization") != "Bearer tok-1" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="`+srv.URL+`/token",service="test"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		reg.ServeHTTP(w, r)
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the untrusted case fails its handshake
	srv.StartTLS()
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "https://")
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	src := Source{URL: "docker://" + host + "/os/fedora:41", CACertPEM: ca, Username: "puller", Password: "pw", AllowedNetworks: loopback}

	digest, err := ResolveDigest(context.Background(), src)
	if err != nil || digest != manifest {
		t.Fatalf("digest %q, %v; want %s", digest, err, manifest)
	}
	if got := scope.Load(); got != "repository:os/fedora:pull test" {
		t.Errorf("token request scope and service %q", got)
	}
	untrusted := src
	untrusted.CACertPEM = nil
	_, err = ResolveDigest(context.Background(), untrusted)
	wantKind(t, err, KindUnreachable)
	insecure := untrusted
	insecure.InsecureRegistries = []string{host}
	if _, err := ResolveDigest(context.Background(), insecure); err != nil {
		t.Errorf("insecure registry: %v", err)
	}
	wrong := src
	wrong.Password = "nope"
	_, err = ResolveDigest(context.Background(), wrong)
	wantKind(t, err, KindUnauthorized)
}
