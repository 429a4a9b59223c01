package console

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// BrainClientName is the client certificate name MintPKI gives the brain.
const BrainClientName = "nodevirt-brain"

// PKI names the files MintPKI wrote.
type PKI struct {
	CAFile                    string
	ServerCertFile, ServerKey string
	ClientCertFile, ClientKey string
}

// MintPKI writes a fresh CA, a server certificate for hosts (IPs or DNS
// names) and a client certificate named BrainClientName, all signed by the
// CA and valid for a day, into dir. It is for tests and labs; a cluster's
// brain provides its own.
func MintPKI(dir string, hosts ...string) (*PKI, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	caKey, caCert, caDER, err := mint(nil, nil, &x509.Certificate{
		Subject:               pkix.Name{CommonName: "nodevirt-console-ca"},
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	})
	if err != nil {
		return nil, err
	}
	srv := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "nodevirt-nodeagent"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			srv.IPAddresses = append(srv.IPAddresses, ip)
		} else {
			srv.DNSNames = append(srv.DNSNames, h)
		}
	}
	srvKey, _, srvDER, err := mint(caCert, caKey, srv)
	if err != nil {
		return nil, err
	}
	cliKey, _, cliDER, err := mint(caCert, caKey, &x509.Certificate{
		Subject:     pkix.Name{CommonName: BrainClientName},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return nil, err
	}
	p := &PKI{
		CAFile:         filepath.Join(dir, "ca.crt"),
		ServerCertFile: filepath.Join(dir, "server.crt"), ServerKey: filepath.Join(dir, "server.key"),
		ClientCertFile: filepath.Join(dir, "client.crt"), ClientKey: filepath.Join(dir, "client.key"),
	}
	srvKeyDER, err := x509.MarshalECPrivateKey(srvKey)
	if err != nil {
		return nil, err
	}
	cliKeyDER, err := x509.MarshalECPrivateKey(cliKey)
	if err != nil {
		return nil, err
	}
	for _, f := range []struct {
		path, typ string
		der       []byte
	}{
		{p.CAFile, "CERTIFICATE", caDER},
		{p.ServerCertFile, "CERTIFICATE", srvDER}, {p.ServerKey, "EC PRIVATE KEY", srvKeyDER},
		{p.ClientCertFile, "CERTIFICATE", cliDER}, {p.ClientKey, "EC PRIVATE KEY", cliKeyDER},
	} {
		if err := os.WriteFile(f.path, pem.EncodeToMemory(&pem.Block{Type: f.typ, Bytes: f.der}), 0o600); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// ServerConfig is the server side of the PKI as a console Config.
func (p *PKI) ServerConfig(addr string) Config {
	return Config{Addr: addr, CertFile: p.ServerCertFile, KeyFile: p.ServerKey, ClientCAFile: p.CAFile}
}

// ClientTLS is the brain's TLS config: its client certificate, trusting
// the CA.
func (p *PKI) ClientTLS() (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(p.ClientCertFile, p.ClientKey)
	if err != nil {
		return nil, err
	}
	pemCA, err := os.ReadFile(p.CAFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pemCA)
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
}

// mint signs tmpl with parent/parentKey (self-signed when nil) and returns
// the new key, certificate and certificate DER.
func mint(parent *x509.Certificate, parentKey *ecdsa.PrivateKey, tmpl *x509.Certificate) (key *ecdsa.PrivateKey, cert *x509.Certificate, der []byte, err error) {
	key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return nil, nil, nil, err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = time.Now().Add(-time.Minute)
	tmpl.NotAfter = time.Now().Add(24 * time.Hour)
	signer, signerKey := parent, parentKey
	if parent == nil {
		signer, signerKey = tmpl, key
	}
	der, err = x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("mint %s: %w", tmpl.Subject.CommonName, err)
	}
	if cert, err = x509.ParseCertificate(der); err != nil {
		return nil, nil, nil, err
	}
	return key, cert, der, nil
}
