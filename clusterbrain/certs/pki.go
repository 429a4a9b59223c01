// Package certs runs the brain's own certificate authority and the serving
// certificate of its webhook server (the kubemacpool-cert-manager and
// virt-operator certificate roles): both live in Secrets of the brain's
// namespace, are renewed before they expire, and are handed to a TLS server
// through GetCertificate so a rotation never fails a handshake.
package certs

import (
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

// KeyPair is a certificate with its private key, PEM-encoded.
type KeyPair struct {
	CertPEM []byte
	KeyPEM  []byte
}

// parsed returns the leaf certificate and the signer of kp.
func (kp KeyPair) parsed() (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cb, _ := pem.Decode(kp.CertPEM)
	if cb == nil {
		return nil, nil, errors.New("no certificate pem block")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("parse certificate: %w", err)
	}
	kb, _ := pem.Decode(kp.KeyPEM)
	if kb == nil {
		return nil, nil, errors.New("no key pem block")
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("parse key: %w", err)
	}
	return cert, key, nil
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
	cert, _, err := kp.parsed()
	if err != nil {
		return time.Time{}, err
	}
	return cert.NotAfter, nil
}

func serial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
}

func encode(der []byte, key *ecdsa.PrivateKey) (KeyPair, error) {
	kd, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return KeyPair{}, err
	}
	return KeyPair{
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd}),
	}, nil
}

// NewCA makes a self-signed CA valid for d from now.
func NewCA(commonName string, d time.Duration, now time.Time) (KeyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return KeyPair{}, err
	}
	sn, err := serial()
	if err != nil {
		return KeyPair{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: fmt.Sprintf("%s@%d", commonName, now.Unix())},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(d),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return KeyPair{}, fmt.Errorf("sign ca: %w", err)
	}
	return encode(der, key)
}

// Issue signs a serving certificate for hosts (DNS names or IPs), valid for
// d from now but never beyond the CA.
func Issue(ca KeyPair, hosts []string, d time.Duration, now time.Time) (KeyPair, error) {
	caCert, caKey, err := ca.parsed()
	if err != nil {
		return KeyPair{}, fmt.Errorf("ca: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return KeyPair{}, err
	}
	sn, err := serial()
	if err != nil {
		return KeyPair{}, err
	}
	notAfter := now.Add(d)
	if notAfter.After(caCert.NotAfter) {
		notAfter = caCert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject:      pkix.Name{CommonName: hosts[0]},
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		return KeyPair{}, fmt.Errorf("sign serving certificate: %w", err)
	}
	return encode(der, key)
}

// signedBy reports whether leaf's certificate was issued by ca.
func signedBy(leaf, ca KeyPair) bool {
	lc, _, err := leaf.parsed()
	if err != nil {
		return false
	}
	cc, _, err := ca.parsed()
	if err != nil {
		return false
	}
	return lc.CheckSignatureFrom(cc) == nil
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
