package importer

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// countingServer serves a small raw image and counts requests.
func countingServer(t *testing.T, addr string, h http.Handler) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var n atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		h.ServeHTTP(w, r)
	}))
	if addr != "" {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Skipf("listen %s: %v", addr, err)
		}
		srv.Listener.Close()
		srv.Listener = ln
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &n
}

var smallImage = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	w.Write(make([]byte, 64<<10))
})

// TestImportsDoNotReachForbiddenNetworks: by default an import reaches no
// loopback server, whether named by address or by a name that resolves
// there, directly or through a redirect, and over the registry API too;
// the server never sees a request.
func TestImportsDoNotReachForbiddenNetworks(t *testing.T) {
	target, hits := countingServer(t, "127.0.0.1:0", smallImage)
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(target.URL, "http://"))
	// An allowed server (127.0.0.2 only) that redirects to the forbidden one.
	redirector, _ := countingServer(t, "127.0.0.2:0", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, target.URL+"/disk.img", http.StatusFound)
	}))
	only2 := []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}
	imp := func(src Source) error {
		_, err := Import(context.Background(), Request{Source: src, Dest: filepath.Join(t.TempDir(), "disk.img"), Capacity: 1 << 20})
		return err
	}
	for name, src := range map[string]Source{
		"address":  {HTTP: &HTTPSource{URL: target.URL + "/disk.img", Retries: -1}},
		"name":     {HTTP: &HTTPSource{URL: "http://localhost:" + port + "/disk.img", Retries: -1}},
		"redirect": {HTTP: &HTTPSource{URL: redirector.URL + "/disk.img", Retries: -1, AllowedNetworks: only2}},
		"registry": {Registry: &RegistrySource{URL: "docker://127.0.0.1:" + port + "/x/y:z", InsecureRegistries: []string{"127.0.0.1:" + port}}},
		"metadata": {HTTP: &HTTPSource{URL: "http://169.254.169.254/latest/meta-data/", Retries: -1}},
	} {
		if err := imp(src); ReasonOf(err) != ReasonNetworkNotAllowed {
			t.Errorf("%s: %v, want %s", name, err, ReasonNetworkNotAllowed)
		}
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("the forbidden server got %d requests", n)
	}
	// Allowed explicitly, the same import works.
	if err := imp(Source{HTTP: &HTTPSource{URL: target.URL + "/disk.img", AllowedNetworks: testNetworks}}); err != nil {
		t.Errorf("allowed import: %v", err)
	}
}

// TestProxiedTargetIsChecked: through a proxy the node dials only the
// proxy, so the target is checked before the request goes out.
func TestProxiedTargetIsChecked(t *testing.T) {
	proxy, hits := countingServer(t, "127.0.0.1:0", smallImage)
	_, err := Import(context.Background(), Request{
		Source: Source{HTTP: &HTTPSource{URL: "http://169.254.169.254/latest/meta-data/", Retries: -1,
			Proxy: &Proxy{HTTPProxy: proxy.URL}}},
		Dest: filepath.Join(t.TempDir(), "disk.img"), Capacity: 1 << 20,
	})
	if ReasonOf(err) != ReasonNetworkNotAllowed {
		t.Errorf("proxied metadata request: %v, want %s", err, ReasonNetworkNotAllowed)
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("the proxy got %d requests", n)
	}
}

// TestHeadersCannotOverride: extra headers may not set Host, framing,
// ranges or the headers metadata services require.
func TestHeadersCannotOverride(t *testing.T) {
	for _, h := range []string{"Host: metadata.google.internal", "host: x", "Metadata-Flavor: Google", "Metadata: true",
		"X-aws-ec2-metadata-token: abc", "X-Google-Metadata-Request: True", "Content-Length: 0", "Transfer-Encoding: chunked",
		"Range: bytes=0-", "Proxy-Authorization: Basic x", "X-Forwarded-For: 127.0.0.1"} {
		_, err := Import(context.Background(), Request{
			Source: Source{HTTP: &HTTPSource{URL: "http://192.0.2.1/disk.img", SecretExtraHeaders: []string{h}}},
			Dest:   filepath.Join(t.TempDir(), "disk.img"), Capacity: 1 << 20,
		})
		if ReasonOf(err) != ReasonInvalidRequest {
			t.Errorf("header %q: %v, want %s", h, err, ReasonInvalidRequest)
		}
	}
	if _, err := parseHeaders([]string{"Authorization: Bearer x", "X-Custom: y"}); err != nil {
		t.Errorf("ordinary headers refused: %v", err)
	}
}
