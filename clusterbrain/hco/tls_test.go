package hco

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestTLSProfileReachesTheServers: the HyperConverged's tlsSecurityProfile,
// rendered into the KubeVirt and CDI CRs, changes what a running server
// built as the daemons build theirs (crwatch + tlsprofile.Follow) accepts,
// without a restart: a client offering only a refused version or suite
// fails its handshake.
func TestTLSProfileReachesTheServers(t *testing.T) {
	e := newEnv(t)
	e.create(hcov1beta1.Name, `{"spec":{"tlsSecurityProfile":{"type":"Modern","modern":{}}}}`)

	w := crwatch.New(e.virt, e.ns)
	kv, cdi := tlsprofile.NewLive(), tlsprofile.NewLive()
	tlsprofile.Follow(w, kv, cdi, testLog())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	servers := map[string]string{"KubeVirt": handshakeServer(t, kv), "CDI": handshakeServer(t, cdi)}

	tls12 := func(suite uint16) *tls.Config {
		return &tls.Config{MinVersion: tls.VersionTLS12, MaxVersion: tls.VersionTLS12, CipherSuites: []uint16{suite}} // #nosec: the point
	}
	gcm12, cbc12 := tls12(tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256), tls12(tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256)
	tls10 := &tls.Config{MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS10, // #nosec: the point
		CipherSuites: []uint16{tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA}}
	tls13 := &tls.Config{MinVersion: tls.VersionTLS13}
	wait := func(profile string, cases map[*tls.Config]bool) {
		t.Helper()
		for cr, addr := range servers {
			testkit.Eventually(t, time.Minute, profile+" through the "+cr+" CR", func() error {
				for c, accepted := range cases {
					err := dial(addr, c)
					if accepted && err != nil {
						return err
					}
					if !accepted && err == nil {
						return errors.New("a client the profile refuses was accepted")
					}
				}
				return nil
			})
		}
	}
	wait("Modern", map[*tls.Config]bool{gcm12: false, tls10: false, tls13: true})
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) {
		hc.Spec.TLSSecurityProfile = &hcov1beta1.TLSSecurityProfile{Type: TLSProfileOld, Old: &struct{}{}}
	})
	wait("Old", map[*tls.Config]bool{gcm12: true, cbc12: true, tls10: true, tls13: true})
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.TLSSecurityProfile = nil })
	wait("Intermediate (the default)", map[*tls.Config]bool{gcm12: true, cbc12: false, tls10: false, tls13: true})
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) {
		hc.Spec.TLSSecurityProfile = &hcov1beta1.TLSSecurityProfile{Type: TLSProfileCustom,
			Custom: &hcov1beta1.CustomTLSProfile{MinTLSVersion: "VersionTLS12", Ciphers: []string{"ECDHE-RSA-AES128-SHA256"}}}
	})
	wait("Custom", map[*tls.Config]bool{gcm12: false, cbc12: true, tls10: false})
}

// handshakeServer accepts TLS connections with live's settings and
// completes their handshakes; it returns the address.
func handshakeServer(t *testing.T, live *tlsprofile.Live) string {
	t.Helper()
	cert := httptest.NewTLSServer(nil) // its RSA test certificate
	base := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: cert.TLS.Certificates}
	cert.Close()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", live.Server(base))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _ = c.(*tls.Conn).Handshake(); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

func dial(addr string, c *tls.Config) error {
	c = c.Clone()
	c.InsecureSkipVerify = true // #nosec: only the handshake is looked at
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", addr, c)
	if err != nil {
		return err
	}
	return conn.Close()
}
