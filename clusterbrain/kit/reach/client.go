package reach

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"
)

// Proxy is the import proxy of the CDI configuration.
type Proxy struct {
	HTTPProxy  string
	HTTPSProxy string
	// NoProxy is a comma-separated list of hosts, domains (".example.com"
	// or "example.com" match subdomains too), CIDRs, or "*".
	NoProxy string
	// TrustedCAPEM holds CA certificates for a TLS-intercepting proxy.
	TrustedCAPEM []byte
}

// Config is what a client built by NewClient trusts and may reach.
type Config struct {
	// CACertPEM holds extra trusted CA certificates, added to the system
	// pool.
	CACertPEM []byte
	// Proxy, when set, routes requests through a proxy; nil means direct
	// (the process environment is not consulted).
	Proxy *Proxy
	// Insecure skips TLS certificate verification (an insecure registry).
	Insecure bool
	// AllowedNetworks are addresses the client may reach although the
	// default policy forbids them (see the package comment).
	AllowedNetworks []netip.Prefix
}

// ConfigError is a Config NewClient cannot build a client from.
type ConfigError struct{ msg string }

func (e *ConfigError) Error() string { return e.msg }

// NewClient builds an HTTP client that enforces the reach policy on every
// dial and redirect, trusting the system CAs plus cfg.CACertPEM (and the
// proxy's CA). It never decompresses transparently: checksums and ranges
// are over the bytes as served. The caller closes its idle connections
// when done (CloseIdleConnections).
func NewClient(cfg Config) (*http.Client, error) {
	pool, err := x509.SystemCertPool()
	if err != nil || pool == nil {
		pool = x509.NewCertPool()
	}
	if len(cfg.CACertPEM) > 0 && !pool.AppendCertsFromPEM(cfg.CACertPEM) {
		return nil, &ConfigError{"no certificate found in the CA bundle"}
	}
	if cfg.Proxy != nil && len(cfg.Proxy.TrustedCAPEM) > 0 && !pool.AppendCertsFromPEM(cfg.Proxy.TrustedCAPEM) {
		return nil, &ConfigError{"no certificate found in the proxy CA bundle"}
	}
	p := &policy{allowed: cfg.AllowedNetworks}
	tr := &http.Transport{
		Proxy:                 proxyFunc(cfg.Proxy, p),
		DialContext:           p.dialer(cfg.Proxy),
		TLSClientConfig:       &tls.Config{RootCAs: pool, InsecureSkipVerify: cfg.Insecure},
		TLSHandshakeTimeout:   30 * time.Second,
		ResponseHeaderTimeout: 60 * time.Second,
		DisableCompression:    true,
		ForceAttemptHTTP2:     true,
		ReadBufferSize:        256 << 10,
	}
	return &http.Client{Transport: tr, CheckRedirect: p.checkRedirect}, nil
}

func proxyFunc(p *Proxy, reach *policy) func(*http.Request) (*url.URL, error) {
	if p == nil {
		return nil
	}
	return func(r *http.Request) (*url.URL, error) {
		raw := p.HTTPProxy
		if r.URL.Scheme == "https" {
			raw = p.HTTPSProxy
		}
		if raw == "" || noProxy(p.NoProxy, r.URL.Hostname()) {
			return nil, nil
		}
		// The proxy, not this host, dials the target: check it here.
		if err := reach.checkHost(r.Context(), r.URL.Hostname()); err != nil {
			return nil, err
		}
		if !strings.Contains(raw, "://") {
			raw = "http://" + raw
		}
		return url.Parse(raw)
	}
}

func noProxy(list, host string) bool {
	ip := net.ParseIP(host)
	for _, e := range strings.Split(list, ",") {
		e = strings.ToLower(strings.TrimSpace(e))
		if h, _, err := net.SplitHostPort(e); err == nil {
			e = h
		}
		switch {
		case e == "":
		case e == "*":
			return true
		case ip != nil && strings.Contains(e, "/"):
			if _, n, err := net.ParseCIDR(e); err == nil && n.Contains(ip) {
				return true
			}
		default:
			d := strings.TrimPrefix(e, ".")
			if h := strings.ToLower(host); h == d || strings.HasSuffix(h, "."+d) {
				return true
			}
		}
	}
	return false
}
