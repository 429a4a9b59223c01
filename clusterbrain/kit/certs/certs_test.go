package certs_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func pool(t *testing.T, bundle []byte) *x509.CertPool {
	t.Helper()
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(bundle) {
		t.Fatal("bundle holds no certificate")
	}
	return p
}

func verifyAt(t *testing.T, m *certs.Manager, bundle []byte, at time.Time) error {
	t.Helper()
	c, err := m.GetCertificate(nil)
	if err != nil {
		return err
	}
	leaf, err := x509.ParseCertificate(c.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	_, err = leaf.Verify(x509.VerifyOptions{Roots: pool(t, bundle), DNSName: "localhost", CurrentTime: at})
	return err
}

func TestRotationKeepsOldAndNewCATrusted(t *testing.T) {
	cp := controlplane.Shared(t)
	kube := cp.Clientset(t)
	ns := cp.Namespace(t)
	clk := &clock{t: time.Now()}
	var published [][]byte
	d := certs.Durations{CA: 10 * time.Hour, CARenewBefore: 5 * time.Hour, Server: 4 * time.Hour, ServerRenewBefore: 2 * time.Hour}
	m, err := certs.New(certs.Config{Kube: kube, Namespace: ns, Now: clk.now, Propagation: time.Minute,
		Durations:     func(context.Context) certs.Durations { return d },
		PublishBundle: func(_ context.Context, b []byte) error { published = append(published, b); return nil }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	next, err := m.Sync(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := clk.now().Add(2 * time.Hour); next.Sub(want) > time.Minute || want.Sub(next) > time.Minute {
		t.Errorf("next sync at %s, want about %s (server renewal)", next, want)
	}
	if len(published) != 1 {
		t.Fatalf("bundle published %d times", len(published))
	}
	for _, name := range []string{"nodevirt-brain-ca", "nodevirt-brain-webhook-cert"} {
		if _, err := kube.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			t.Errorf("secret %s: %v", name, err)
		}
	}

	// A real handshake against a server using GetCertificate.
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{GetCertificate: m.GetCertificate})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	cl := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool(t, m.CABundle())}}}
	resp, err := cl.Get("https://" + ln.Addr().(*net.TCPAddr).String())
	if err != nil {
		t.Fatalf("handshake: %v", err)
	}
	resp.Body.Close()
	first, _ := m.GetCertificate(nil)

	// Past the server's renewal point: new leaf, same CA, no new bundle.
	clk.add(2*time.Hour + time.Minute)
	if _, err := m.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	second, _ := m.GetCertificate(nil)
	if string(second.Certificate[0]) == string(first.Certificate[0]) || len(published) != 1 {
		t.Errorf("server certificate not renewed alone (bundles published: %d)", len(published))
	}

	// Past the CA's renewal point: a new CA joins the bundle, the old leaf
	// keeps serving until the bundle had time to propagate.
	clk.add(3 * time.Hour)
	if _, err := m.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if len(published) != 2 {
		t.Fatalf("bundle published %d times, want 2", len(published))
	}
	bundle := published[1]
	if n := strings.Count(string(bundle), "BEGIN CERTIFICATE"); n != 2 {
		t.Errorf("bundle holds %d CAs, want old and new", n)
	}
	if err := verifyAt(t, m, bundle, clk.now()); err != nil {
		t.Errorf("old leaf not trusted by the new bundle: %v", err)
	}
	held, _ := m.GetCertificate(nil)
	if string(held.Certificate[0]) != string(second.Certificate[0]) {
		t.Error("leaf switched before the bundle propagated")
	}
	clk.add(2 * time.Minute)
	if _, err := m.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	third, _ := m.GetCertificate(nil)
	if string(third.Certificate[0]) == string(second.Certificate[0]) {
		t.Fatal("leaf not reissued by the new ca")
	}
	if err := verifyAt(t, m, bundle, clk.now()); err != nil {
		t.Errorf("new leaf not trusted: %v", err)
	}
	// Another manager (a restarted brain) adopts the stored state.
	m2, _ := certs.New(certs.Config{Kube: kube, Namespace: ns, Now: clk.now, Durations: func(context.Context) certs.Durations { return d }})
	if _, err := m2.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	c2, _ := m2.GetCertificate(nil)
	if string(c2.Certificate[0]) != string(third.Certificate[0]) {
		t.Error("a restarted manager issued a new certificate instead of using the stored one")
	}
}
