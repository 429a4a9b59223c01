package tlsprofile

import (
	"crypto/tls"
	"io"
	"log"
	"net/http/httptest"
	"slices"
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

// client is what a TLS client offers: versions and TLS 1.0–1.2 suites.
type client struct {
	min, max uint16
	suites   []uint16
}

var (
	tls12GCM  = client{tls.VersionTLS12, tls.VersionTLS12, []uint16{tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256}}
	tls12CBC  = client{tls.VersionTLS12, tls.VersionTLS12, []uint16{tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256}}
	tls10CBC  = client{tls.VersionTLS10, tls.VersionTLS10, []uint16{tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA}}
	tls13Only = client{tls.VersionTLS13, tls.VersionTLS13, nil}
)

// handshake dials addr as c and reports the handshake's error.
func (c client) handshake(addr string) error {
	conn, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true, MinVersion: c.min, MaxVersion: c.max, // #nosec: test server
		CipherSuites: c.suites})
	if err != nil {
		return err
	}
	return conn.Close()
}

// Serve starts a real TLS server with live's settings over base (the
// certificate of net/http/httptest's RSA test server), closed with the test.
func serve(t *testing.T, live *Live, base *tls.Config) string {
	t.Helper()
	cert := httptest.NewTLSServer(nil)
	base.Certificates = cert.TLS.Certificates
	cert.Close()
	srv := httptest.NewUnstartedServer(nil)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refusals the tests provoke
	srv.TLS = live.Server(base)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

func expect(t *testing.T, addr, name string, c client, accepted bool) {
	t.Helper()
	err := c.handshake(addr)
	if accepted && err != nil {
		t.Errorf("%s: refused: %v", name, err)
	}
	if !accepted && err == nil {
		t.Errorf("%s: accepted", name)
	}
}

// Each predefined profile, read from a CDI CR as the hco role renders it,
// takes effect on the next handshake of a running server.
func TestProfilesApplyLive(t *testing.T) {
	live := NewLive()
	addr := serve(t, live, &tls.Config{MinVersion: tls.VersionTLS12})
	cdi := func(p *cdiv1.TLSSecurityProfile) *cdiv1.CDI {
		return &cdiv1.CDI{Spec: cdiv1.CDISpec{Config: &cdiv1.CDIConfigSpec{TLSSecurityProfile: p}}}
	}
	for _, c := range []struct {
		name                        string
		cr                          *cdiv1.CDI
		gcm12, cbc12, cbc10, only13 bool
	}{
		{"no CR", nil, true, false, false, true},
		{"Old", cdi(&cdiv1.TLSSecurityProfile{Type: cdiv1.TLSProfileOldType, Old: &cdiv1.OldTLSProfile{}}), true, true, true, true},
		{"Intermediate", cdi(&cdiv1.TLSSecurityProfile{Type: cdiv1.TLSProfileIntermediateType}), true, false, false, true},
		{"Modern", cdi(&cdiv1.TLSSecurityProfile{Type: cdiv1.TLSProfileModernType}), false, false, false, true},
		{"Custom", cdi(&cdiv1.TLSSecurityProfile{Type: cdiv1.TLSProfileCustomType, Custom: &cdiv1.CustomTLSProfile{TLSProfileSpec: cdiv1.TLSProfileSpec{
			MinTLSVersion: cdiv1.VersionTLS12, Ciphers: []string{"ECDHE-RSA-AES128-SHA256"}}}}), false, true, false, true},
		// Only suites Go lacks for TLS 1.2: TLS 1.3 alone.
		{"Custom DHE", cdi(&cdiv1.TLSSecurityProfile{Type: cdiv1.TLSProfileCustomType, Custom: &cdiv1.CustomTLSProfile{TLSProfileSpec: cdiv1.TLSProfileSpec{
			MinTLSVersion: cdiv1.VersionTLS10, Ciphers: []string{"DHE-RSA-AES128-GCM-SHA256"}}}}), false, false, false, true},
	} {
		live.Set(FromCDI(c.cr))
		expect(t, addr, c.name+" TLS 1.2 GCM", tls12GCM, c.gcm12)
		expect(t, addr, c.name+" TLS 1.2 CBC", tls12CBC, c.cbc12)
		expect(t, addr, c.name+" TLS 1.0 CBC", tls10CBC, c.cbc10)
		expect(t, addr, c.name+" TLS 1.3", tls13Only, c.only13)
	}
}

// The KubeVirt CR's tlsConfiguration (IANA names, as virt-operator reads
// them) applies over a server's own per-client configuration, which keeps
// its certificate and client-auth choice.
func TestKubeVirtSettingsOverPerClientConfig(t *testing.T) {
	live := NewLive()
	inner := &tls.Config{MinVersion: tls.VersionTLS12}
	calls := 0
	base := &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { calls++; return inner, nil }}
	addr := serve(t, live, base)
	inner.Certificates = base.Certificates
	kv := &kubevirtv1.KubeVirt{Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
		TLSConfiguration: &kubevirtv1.TLSConfiguration{MinTLSVersion: kubevirtv1.VersionTLS12,
			Ciphers: []string{"TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384"}}}}}
	live.Set(FromKubeVirt(kv))
	expect(t, addr, "suite not listed", tls12GCM, false)
	expect(t, addr, "suite listed", client{tls.VersionTLS12, tls.VersionTLS12, []uint16{tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384}}, true)
	if calls != 2 {
		t.Errorf("the server's own GetConfigForClient ran %d times, want 2", calls)
	}
	kv.Spec.Configuration.TLSConfiguration.MinTLSVersion = kubevirtv1.VersionTLS13
	live.Set(FromKubeVirt(kv))
	expect(t, addr, "TLS 1.2 under a TLS 1.3 minimum", client{tls.VersionTLS12, tls.VersionTLS12, []uint16{tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384}}, false)
	expect(t, addr, "TLS 1.3", tls13Only, true)
	if inner.MinVersion != tls.VersionTLS12 || inner.CipherSuites != nil {
		t.Error("the server's own configuration was changed in place")
	}
}

func TestSpecsAndNames(t *testing.T) {
	if s := FromNames("VersionTLS11", nil); s.MinVersion != tls.VersionTLS11 || s.CipherSuites != nil {
		t.Errorf("no names: %+v", s)
	}
	if s := FromNames("bogus", []string{"TLS_AES_128_GCM_SHA256"}); s.MinVersion != tls.VersionTLS13 {
		t.Errorf("TLS 1.3 names only: %+v", s)
	}
	if got := IANACiphers(SpecOf(Modern, nil).Ciphers); !slices.Equal(got, TLS13Ciphers) {
		t.Errorf("modern: %v", got)
	}
	if SpecOf(Custom, nil).MinTLSVersion != "VersionTLS12" || SpecOf("", nil).MinTLSVersion != "VersionTLS12" {
		t.Error("a custom profile without its part, or no type, is not Intermediate")
	}
	var l *Live
	if l.Get().MinVersion != tls.VersionTLS12 {
		t.Error("nil Live is not the default")
	}
}
