package console

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
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
// CA and valid for a day, into dir. It is for tests and labs; in a cluster
// the brain signs each node's certificate (nodeagent/nodecert).
func MintPKI(dir string, hosts ...string) (*PKI, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	now := time.Now()
	ca, err := certs.CreateCA("nodevirt-console-ca", 24*time.Hour, now)
	if err != nil {
		return nil, err
	}
	dns, ips := certs.Hosts(hosts...)
	srv, err := ca.Issue(certs.Leaf{CommonName: "nodevirt-nodeagent", DNSNames: dns, IPs: ips, Server: true, Duration: 24 * time.Hour, Now: now})
	if err != nil {
		return nil, err
	}
	cli, err := ca.Issue(certs.Leaf{CommonName: BrainClientName, Client: true, Duration: 24 * time.Hour, Now: now})
	if err != nil {
		return nil, err
	}
	p := &PKI{
		CAFile:         filepath.Join(dir, "ca.crt"),
		ServerCertFile: filepath.Join(dir, "server.crt"), ServerKey: filepath.Join(dir, "server.key"),
		ClientCertFile: filepath.Join(dir, "client.crt"), ClientKey: filepath.Join(dir, "client.key"),
	}
	for path, data := range map[string][]byte{
		p.CAFile:         ca.CertPEM,
		p.ServerCertFile: srv.CertPEM, p.ServerKey: srv.KeyPEM,
		p.ClientCertFile: cli.CertPEM, p.ClientKey: cli.KeyPEM,
	} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
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
	pool, err := certs.Pool(pemCA)
	if err != nil {
		return nil, err
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
}
