package reach

import (
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync/atomic"
	"testing"
)

// server serves on addr and counts requests.
func server(t *testing.T, addr string, h http.HandlerFunc) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var n atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		h(w, r)
	}))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("listen %s: %v", addr, err)
	}
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &n
}

// TestClientEnforcesPolicy: a client of NewClient does not reach a
// loopback server directly, through a redirect from an allowed one, or
// through a proxy; allowed explicitly, it does.
func TestClientEnforcesPolicy(t *testing.T) {
	target, hits := server(t, "127.0.0.1:0", func(w http.ResponseWriter, r *http.Request) {})
	redirector, _ := server(t, "127.0.0.2:0", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, target.URL+"/x", http.StatusFound)
	})
	proxy, proxied := server(t, "127.0.0.1:0", func(w http.ResponseWriter, r *http.Request) {})
	get := func(cfg Config, url string) error {
		c, err := NewClient(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer c.CloseIdleConnections()
		resp, err := c.Get(url)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	only2 := []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}
	for name, err := range map[string]error{
		"direct":   get(Config{}, target.URL),
		"redirect": get(Config{AllowedNetworks: only2}, redirector.URL),
		"proxied":  get(Config{Proxy: &Proxy{HTTPProxy: proxy.URL}}, "http://169.254.169.254/latest/meta-data/"),
	} {
		if !IsNotAllowed(err) {
			t.Errorf("%s: %v, want a *NotAllowedError", name, err)
		}
	}
	if n, p := hits.Load(), proxied.Load(); n != 0 || p != 0 {
		t.Errorf("the forbidden server got %d requests, the proxy %d", n, p)
	}
	if err := get(Config{AllowedNetworks: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}, target.URL); err != nil {
		t.Errorf("allowed: %v", err)
	}
	if _, err := NewClient(Config{CACertPEM: []byte("no pem")}); err == nil {
		t.Error("a CA bundle without certificates accepted")
	}
}

func TestNoProxy(t *testing.T) {
	for _, c := range []struct {
		list, host string
		want       bool
	}{
		{"example.com", "example.com", true}, {".example.com", "a.example.com", true}, {"example.com", "a.example.com", true},
		{"example.com", "notexample.com", false}, {"*", "anything", true}, {"10.0.0.0/8, 127.0.0.0/8", "127.0.0.1", true},
		{"10.0.0.0/8", "192.0.2.1", false}, {"example.com:8080", "example.com", true}, {"", "example.com", false},
	} {
		if got := noProxy(c.list, c.host); got != c.want {
			t.Errorf("noProxy(%q, %q) = %v, want %v", c.list, c.host, got, c.want)
		}
	}
}
