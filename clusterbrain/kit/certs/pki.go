// Package certs is nodevirt's one PKI package: certificate authorities,
// leaf certificates (serving and client, DNS and IP names, lifetimes),
// certificate signing requests, PEM encoding and parsing, and the renewal
// check every rotating holder uses.
//
// On top of it, Manager runs the brain's own certificate authority and the
// serving certificate of its webhook server (the kubemacpool-cert-manager
// and virt-operator certificate roles): both live in Secrets of the brain's
// namespace, are renewed before they expire, and are handed to a TLS server
// through GetCertificate so a rotation never fails a handshake.
package certs

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"time"
)

// PEM block types.
const (
	BlockCertificate = "CERTIFICATE"
	BlockECKey       = "EC PRIVATE KEY"
	BlockPKCS8Key    = "PRIVATE KEY"
	BlockRSAKey      = "RSA PRIVATE KEY"
	BlockCSR         = "CERTIFICATE REQUEST"
)

// DefaultLeafDuration is the lifetime of a leaf whose Leaf.Duration is zero.
const DefaultLeafDuration = 365 * 24 * time.Hour

// backdate is how far before "now" certificates start, for clock skew.
const backdate = 5 * time.Minute

// KeyPair is a certificate with its private key, PEM-encoded.
type KeyPair struct {
	CertPEM []byte
	KeyPEM  []byte
}

// Parse returns the first certificate of kp and its private key.
func (kp KeyPair) Parse() (*x509.Certificate, crypto.Signer, error) {
	certs, err := ParseCertificates(kp.CertPEM)
	if err != nil {
		return nil, nil, err
	}
	key, err := ParseKey(kp.KeyPEM)
	if err != nil {
		return nil, nil, err
	}
	return certs[0], key, nil
}

// TLSCertificate converts kp for a tls.Config.
func (kp KeyPair) TLSCertificate() (*tls.Certificate, error) {
	c, err := tls.X509KeyPair(kp.CertPEM, kp.KeyPEM)
	if err != nil {
		return nil, fmt.Errorf("load key pair: %w", err)
	}
	return &c, nil
}

// NotAfter returns when kp's certificate expires.
func (kp KeyPair) NotAfter() (time.Time, error) {
	certs, err := ParseCertificates(kp.CertPEM)
	if err != nil {
		return time.Time{}, err
	}
	return certs[0].NotAfter, nil
}

// GenerateKey makes a new P-256 private key.
func GenerateKey() (*ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key: %w", err)
	}
	return key, nil
}

// EncodeCertificate returns der as a PEM CERTIFICATE block.
func EncodeCertificate(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: BlockCertificate, Bytes: der})
}

// EncodeKey returns key as PEM: SEC1 ("EC PRIVATE KEY") for ECDSA keys,
// PKCS#8 otherwise.
func EncodeKey(key crypto.Signer) ([]byte, error) {
	if ec, ok := key.(*ecdsa.PrivateKey); ok {
		der, err := x509.MarshalECPrivateKey(ec)
		if err != nil {
			return nil, fmt.Errorf("encode key: %w", err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: BlockECKey, Bytes: der}), nil
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encode key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: BlockPKCS8Key, Bytes: der}), nil
}

// ParseKey reads the first private key of data (SEC1, PKCS#1 or PKCS#8).
func ParseKey(data []byte) (crypto.Signer, error) {
	for rest := data; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			return nil, errors.New("no private key pem block")
		}
		var (
			key any
			err error
		)
		switch b.Type {
		case BlockECKey:
			key, err = x509.ParseECPrivateKey(b.Bytes)
		case BlockRSAKey:
			key, err = x509.ParsePKCS1PrivateKey(b.Bytes)
		case BlockPKCS8Key:
			key, err = x509.ParsePKCS8PrivateKey(b.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", b.Type, err)
		}
		s, ok := key.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("%T is not a signing key", key)
		}
		return s, nil
	}
}

// ParseCertificates reads every CERTIFICATE block of data, in order; it
// fails when there is none.
func ParseCertificates(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for rest := data; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		if b.Type != BlockCertificate {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no certificate pem block")
	}
	return out, nil
}

// Pool returns a pool of every certificate in the PEM bundles.
func Pool(bundles ...[]byte) (*x509.CertPool, error) {
	p := x509.NewCertPool()
	for _, b := range bundles {
		certs, err := ParseCertificates(b)
		if err != nil {
			return nil, err
		}
		for _, c := range certs {
			p.AddCert(c)
		}
	}
	return p, nil
}

// RenewAt is when a holder of cert renews it: renewBefore ahead of its
// expiry, or, when renewBefore is zero or not shorter than the lifetime,
// once two thirds of the lifetime have passed.
func RenewAt(cert *x509.Certificate, renewBefore time.Duration) time.Time {
	life := cert.NotAfter.Sub(cert.NotBefore)
	if renewBefore <= 0 || renewBefore >= life {
		return cert.NotBefore.Add(life * 2 / 3)
	}
	return cert.NotAfter.Add(-renewBefore)
}

// DueForRenewal reports whether cert must be renewed at now (see RenewAt).
func DueForRenewal(cert *x509.Certificate, now time.Time, renewBefore time.Duration) bool {
	return !now.Before(RenewAt(cert, renewBefore))
}

func serial() (*big.Int, error) {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	if err != nil {
		return nil, fmt.Errorf("serial number: %w", err)
	}
	return n, nil
}

// CA is a certificate authority that can sign.
type CA struct {
	Cert    *x509.Certificate
	CertPEM []byte
	Key     crypto.Signer
}

// CreateCA makes a self-signed CA named commonName, valid for d from now.
func CreateCA(commonName string, d time.Duration, now time.Time) (*CA, error) {
	key, err := GenerateKey()
	if err != nil {
		return nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: commonName},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(d),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("sign ca %s: %w", commonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, CertPEM: EncodeCertificate(der), Key: key}, nil
}

// ParseCA builds a CA from its PEM certificate and key.
func ParseCA(certPEM, keyPEM []byte) (*CA, error) {
	kp := KeyPair{CertPEM: certPEM, KeyPEM: keyPEM}
	cert, key, err := kp.Parse()
	if err != nil {
		return nil, fmt.Errorf("ca: %w", err)
	}
	if !cert.IsCA {
		return nil, errors.New("ca: not a certificate authority")
	}
	if _, err := tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return nil, fmt.Errorf("ca: %w", err)
	}
	return &CA{Cert: cert, CertPEM: EncodeCertificate(cert.Raw), Key: key}, nil
}

// KeyPair returns the CA's certificate and key as PEM.
func (ca *CA) KeyPair() (KeyPair, error) {
	k, err := EncodeKey(ca.Key)
	if err != nil {
		return KeyPair{}, err
	}
	return KeyPair{CertPEM: ca.CertPEM, KeyPEM: k}, nil
}

// Pool is a pool holding only the CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Leaf describes a certificate a CA signs.
type Leaf struct {
	CommonName   string
	Organization []string
	DNSNames     []string
	IPs          []net.IP
	// Server and Client select the extended key usages (server auth,
	// client auth); at least one is required.
	Server, Client bool
	// Duration is the lifetime (DefaultLeafDuration when zero), cut to the
	// CA's own expiry.
	Duration time.Duration
	// Now is the issuing time (time.Now when zero).
	Now time.Time
}

// Hosts splits names into DNS names and IP addresses.
func Hosts(names ...string) (dns []string, ips []net.IP) {
	for _, h := range names {
		if ip := net.ParseIP(h); ip != nil {
			ips = append(ips, ip)
		} else {
			dns = append(dns, h)
		}
	}
	return dns, ips
}

// Sign signs a certificate for pub as described by l.
func (ca *CA) Sign(l Leaf, pub crypto.PublicKey) (*x509.Certificate, error) {
	if !l.Server && !l.Client {
		return nil, fmt.Errorf("sign %s: neither server nor client usage", l.CommonName)
	}
	now := l.Now
	if now.IsZero() {
		now = time.Now()
	}
	d := l.Duration
	if d == 0 {
		d = DefaultLeafDuration
	}
	notAfter := now.Add(d)
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject:      pkix.Name{CommonName: l.CommonName, Organization: l.Organization},
		NotBefore:    now.Add(-backdate),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		DNSNames:     l.DNSNames,
		IPAddresses:  l.IPs,
	}
	if l.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if l.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, pub, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("sign %s: %w", l.CommonName, err)
	}
	return x509.ParseCertificate(der)
}

// Issue makes a key and signs a certificate for it as described by l.
func (ca *CA) Issue(l Leaf) (KeyPair, error) {
	key, err := GenerateKey()
	if err != nil {
		return KeyPair{}, err
	}
	cert, err := ca.Sign(l, key.Public())
	if err != nil {
		return KeyPair{}, err
	}
	kp, err := EncodeKey(key)
	if err != nil {
		return KeyPair{}, err
	}
	return KeyPair{CertPEM: EncodeCertificate(cert.Raw), KeyPEM: kp}, nil
}

// IssueTLS is Issue for a TLS server or client: the chain carries the leaf
// then the CA.
func (ca *CA) IssueTLS(l Leaf) (tls.Certificate, error) {
	kp, err := ca.Issue(l)
	if err != nil {
		return tls.Certificate{}, err
	}
	c, err := tls.X509KeyPair(append(kp.CertPEM, ca.CertPEM...), kp.KeyPEM)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("issue %s: %w", l.CommonName, err)
	}
	return c, nil
}

// NewCSR makes a PEM certificate signing request for key.
func NewCSR(key crypto.Signer, subject pkix.Name, dnsNames []string, ips []net.IP) ([]byte, error) {
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: subject, DNSNames: dnsNames, IPAddresses: ips}, key)
	if err != nil {
		return nil, fmt.Errorf("create csr: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: BlockCSR, Bytes: der}), nil
}

// ParseCSR reads a PEM certificate signing request and checks its
// signature.
func ParseCSR(data []byte) (*x509.CertificateRequest, error) {
	b, _ := pem.Decode(data)
	if b == nil || b.Type != BlockCSR {
		return nil, errors.New("no certificate request pem block")
	}
	csr, err := x509.ParseCertificateRequest(b.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parse csr: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("csr signature: %w", err)
	}
	return csr, nil
}

// NewCA makes a self-signed CA valid for d from now, named commonName@<unix
// time> so that successive CAs of a rotation differ, as a KeyPair.
func NewCA(commonName string, d time.Duration, now time.Time) (KeyPair, error) {
	ca, err := CreateCA(fmt.Sprintf("%s@%d", commonName, now.Unix()), d, now)
	if err != nil {
		return KeyPair{}, err
	}
	return ca.KeyPair()
}

// Issue signs a serving certificate for hosts (DNS names or IPs; the first
// is the common name), valid for d from now but never beyond the CA.
func Issue(ca KeyPair, hosts []string, d time.Duration, now time.Time) (KeyPair, error) {
	if len(hosts) == 0 {
		return KeyPair{}, errors.New("issue: no host names")
	}
	c, err := ParseCA(ca.CertPEM, ca.KeyPEM)
	if err != nil {
		return KeyPair{}, err
	}
	dns, ips := Hosts(hosts...)
	return c.Issue(Leaf{CommonName: hosts[0], DNSNames: dns, IPs: ips, Server: true, Duration: d, Now: now})
}

// signedBy reports whether leaf's certificate was issued by ca.
func signedBy(leaf, ca KeyPair) bool {
	lc, err := ParseCertificates(leaf.CertPEM)
	if err != nil {
		return false
	}
	cc, err := ParseCertificates(ca.CertPEM)
	if err != nil {
		return false
	}
	return lc[0].CheckSignatureFrom(cc[0]) == nil
}

// covers reports whether leaf's certificate is valid for every DNS name
// of hosts (a secret issued for other names, such as localhost before the
// webhooks moved behind a Service, is reissued). Addresses are not
// compared: replicas sharing a secret each add their own.
func covers(leaf KeyPair, hosts []string) bool {
	lc, err := ParseCertificates(leaf.CertPEM)
	if err != nil {
		return false
	}
	dns, _ := Hosts(hosts...)
	for _, h := range dns {
		if lc[0].VerifyHostname(h) != nil {
			return false
		}
	}
	return true
}

// bundleAppend returns bundle with ca's certificate added, dropping
// certificates that expired before now and keeping at most keep of them
// (newest last), so clients trust both the old and the new CA across a
// rotation.
func bundleAppend(bundle []byte, ca []byte, now time.Time, keep int) []byte {
	var certs [][]byte
	rest := append(append([]byte(nil), bundle...), ca...)
	seen := map[string]bool{}
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil || c.NotAfter.Before(now) || seen[string(b.Bytes)] {
			continue
		}
		seen[string(b.Bytes)] = true
		certs = append(certs, pem.EncodeToMemory(b))
	}
	if len(certs) > keep {
		certs = certs[len(certs)-keep:]
	}
	var out []byte
	for _, c := range certs {
		out = append(out, c...)
	}
	return out
}
