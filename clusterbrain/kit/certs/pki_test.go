package certs

import (
	"crypto"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net"
	"slices"
	"testing"
	"time"
)

func TestIssueServingAndClient(t *testing.T) {
	now := time.Now()
	ca, err := CreateCA("test-ca", 10*time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	dns, ips := Hosts("node-a", "10.1.2.3", "localhost")
	srv, err := ca.Issue(Leaf{CommonName: "node-a", Organization: []string{"grp"}, DNSNames: dns, IPs: ips, Server: true, Duration: time.Hour, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	cert, key, err := srv.Parse()
	if err != nil {
		t.Fatal(err)
	}
	if !key.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(cert.PublicKey) {
		t.Error("key does not match certificate")
	}
	if cert.Subject.CommonName != "node-a" || !slices.Equal(cert.Subject.Organization, []string{"grp"}) {
		t.Errorf("subject %v", cert.Subject)
	}
	if got := cert.NotAfter.Sub(now); got > time.Hour || got < time.Hour-time.Second {
		t.Errorf("lifetime %s, want 1h", got)
	}
	for _, host := range []string{"node-a", "localhost", "10.1.2.3"} {
		if _, err := cert.Verify(x509.VerifyOptions{Roots: ca.Pool(), DNSName: host, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("verify for %s: %v", host, err)
		}
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Error("a serving certificate verified as a client certificate")
	}
	// A leaf never outlives its CA.
	long, err := ca.Issue(Leaf{CommonName: "c", Client: true, Duration: 100 * time.Hour, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	if exp, _ := long.NotAfter(); !exp.Equal(ca.Cert.NotAfter.Truncate(time.Second)) {
		t.Errorf("leaf expires %s, CA %s", exp, ca.Cert.NotAfter)
	}
	if _, err := ca.Issue(Leaf{CommonName: "nothing"}); err == nil {
		t.Error("a leaf without usage was issued")
	}
	// A CA read back from PEM signs what the original's pool trusts.
	kp, err := ca.KeyPair()
	if err != nil {
		t.Fatal(err)
	}
	again, err := ParseCA(kp.CertPEM, kp.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	tc, err := again.IssueTLS(Leaf{CommonName: "client", Client: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(tc.Certificate) != 2 {
		t.Fatalf("chain of %d certificates, want leaf and CA", len(tc.Certificate))
	}
	leaf, _ := x509.ParseCertificate(tc.Certificate[0])
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("client certificate of the parsed CA: %v", err)
	}
	if _, err := ParseCA(srv.CertPEM, srv.KeyPEM); err == nil {
		t.Error("a leaf was accepted as a CA")
	}
}

func TestCSRRoundTrip(t *testing.T) {
	key, err := GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	pemCSR, err := NewCSR(key, pkix.Name{CommonName: "system:node:a", Organization: []string{"nodes"}}, []string{"a"}, []net.IP{net.IPv4(10, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	csr, err := ParseCSR(pemCSR)
	if err != nil {
		t.Fatal(err)
	}
	if csr.Subject.CommonName != "system:node:a" || !slices.Equal(csr.DNSNames, []string{"a"}) || len(csr.IPAddresses) != 1 {
		t.Errorf("csr %v %v %v", csr.Subject, csr.DNSNames, csr.IPAddresses)
	}
	tampered := append([]byte(nil), pemCSR...)
	tampered[len(tampered)/2] ^= 1
	if _, err := ParseCSR(tampered); err == nil {
		t.Error("a tampered csr parsed")
	}
	// PKCS#8 keys (the upload CA's format) parse as well.
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseKey(pem.EncodeToMemory(&pem.Block{Type: BlockPKCS8Key, Bytes: der}))
	if err != nil || !key.Equal(back) {
		t.Errorf("pkcs8 key round trip: %v", err)
	}
}

func TestRenewAt(t *testing.T) {
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	c := &x509.Certificate{NotBefore: start, NotAfter: start.Add(30 * time.Hour)}
	if got := RenewAt(c, 0); !got.Equal(start.Add(20 * time.Hour)) {
		t.Errorf("default renewal at %s", got)
	}
	if got := RenewAt(c, 6*time.Hour); !got.Equal(start.Add(24 * time.Hour)) {
		t.Errorf("renewal 6h ahead at %s", got)
	}
	if DueForRenewal(c, start.Add(19*time.Hour), 0) || !DueForRenewal(c, start.Add(20*time.Hour), 0) {
		t.Error("due check wrong around the renewal point")
	}
}
