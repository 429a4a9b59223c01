// Package tlsprofile turns the TLS settings of the rendered KubeVirt and CDI
// CRs into the settings of nodevirt's own TLS servers, and keeps them live.
//
// The HyperConverged's spec.tlsSecurityProfile (OpenShift's TLSSecurityProfile:
// Old, Intermediate, Modern or Custom) is rendered by the brain's hco role
// into the KubeVirt CR's spec.configuration.tlsConfiguration (minimum version
// and IANA cipher names, as virt-operator writes it) and the CDI CR's
// spec.config.tlsSecurityProfile (the profile itself). Who reads which:
//
//   - the KubeVirt CR (FromKubeVirt): the roles KubeVirt's virt-api and
//     virt-handler play: the brain's admission webhooks and aggregated APIs,
//     the node agent's console/VNC/control server;
//   - the CDI CR (FromCDI): the roles of CDI's apiserver, upload proxy and
//     upload server: the brain's upload API and proxy, the node agent's upload
//     receiver and volume export (one listener).
//
// A server built with Live.Server reads the settings at every handshake, so
// a changed CR takes effect on the next connection without a restart;
// connections already open keep what they negotiated. With no CR (or no
// setting in it) the servers keep KubeVirt's and CDI's default: TLS 1.2 and
// Go's default cipher suites.
//
// Go does not let the TLS 1.3 suites be chosen: a profile constrains the
// suites of TLS 1.0–1.2 only. A profile whose list names no suite Go has for
// TLS 1.2 and below (for example only DHE suites, or only TLS 1.3 names)
// allows TLS 1.3 alone, as OpenSSL serves no older version without a suite
// for it.
package tlsprofile

import (
	"crypto/tls"
	"slices"
	"sync/atomic"

	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

// Profile types (OpenShift's TLSProfileType).
const (
	Old          = "Old"
	Intermediate = "Intermediate"
	Modern       = "Modern"
	Custom       = "Custom"
)

// Versions are the protocol versions as profiles spell them.
var Versions = map[string]uint16{
	"VersionTLS10": tls.VersionTLS10,
	"VersionTLS11": tls.VersionTLS11,
	"VersionTLS12": tls.VersionTLS12,
	"VersionTLS13": tls.VersionTLS13,
}

// TLS13Ciphers are the TLS 1.3 suites (the same name in OpenSSL and IANA).
var TLS13Ciphers = []string{"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}

var intermediateCiphers = append(slices.Clone(TLS13Ciphers),
	"ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
	"ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
	"ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
	"DHE-RSA-AES128-GCM-SHA256", "DHE-RSA-AES256-GCM-SHA384")

var oldCiphers = append(slices.Clone(intermediateCiphers),
	"DHE-RSA-CHACHA20-POLY1305",
	"ECDHE-ECDSA-AES128-SHA256", "ECDHE-RSA-AES128-SHA256", "ECDHE-ECDSA-AES128-SHA", "ECDHE-RSA-AES128-SHA",
	"ECDHE-ECDSA-AES256-SHA384", "ECDHE-RSA-AES256-SHA384", "ECDHE-ECDSA-AES256-SHA", "ECDHE-RSA-AES256-SHA",
	"DHE-RSA-AES128-SHA256", "DHE-RSA-AES256-SHA256",
	"AES128-GCM-SHA256", "AES256-GCM-SHA384", "AES128-SHA256", "AES256-SHA256", "AES128-SHA", "AES256-SHA",
	"DES-CBC3-SHA")

// Spec is what a profile stands for: its minimum version and its cipher
// suites by OpenSSL name.
type Spec struct {
	MinTLSVersion string
	Ciphers       []string
}

var predefined = map[string]Spec{
	Old:          {"VersionTLS10", oldCiphers},
	Intermediate: {"VersionTLS12", intermediateCiphers},
	Modern:       {"VersionTLS13", TLS13Ciphers},
}

// SpecOf resolves a profile of type typ (custom: its Custom part) to its
// version and ciphers; an unknown or empty type is Intermediate, and so is
// Custom without a custom part.
func SpecOf(typ string, custom *Spec) Spec {
	if typ == Custom && custom != nil {
		return *custom
	}
	if s, ok := predefined[typ]; ok {
		return s
	}
	return predefined[Intermediate]
}

// openSSLToIANA gives the IANA names of the profiles' OpenSSL names.
var openSSLToIANA = map[string]string{
	"DHE-RSA-AES128-GCM-SHA256":     "TLS_DHE_RSA_WITH_AES_128_GCM_SHA256",
	"DHE-RSA-AES256-GCM-SHA384":     "TLS_DHE_RSA_WITH_AES_256_GCM_SHA384",
	"DHE-RSA-CHACHA20-POLY1305":     "TLS_DHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
	"DHE-RSA-AES128-SHA256":         "TLS_DHE_RSA_WITH_AES_128_CBC_SHA256",
	"DHE-RSA-AES256-SHA256":         "TLS_DHE_RSA_WITH_AES_256_CBC_SHA256",
	"AES256-SHA256":                 "TLS_RSA_WITH_AES_256_CBC_SHA256",
	"TLS_AES_128_GCM_SHA256":        "TLS_AES_128_GCM_SHA256",
	"TLS_AES_256_GCM_SHA384":        "TLS_AES_256_GCM_SHA384",
	"TLS_CHACHA20_POLY1305_SHA256":  "TLS_CHACHA20_POLY1305_SHA256",
	"ECDHE-ECDSA-AES128-GCM-SHA256": "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
	"ECDHE-RSA-AES128-GCM-SHA256":   "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
	"ECDHE-ECDSA-AES256-GCM-SHA384": "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
	"ECDHE-RSA-AES256-GCM-SHA384":   "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
	"ECDHE-ECDSA-CHACHA20-POLY1305": "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
	"ECDHE-RSA-CHACHA20-POLY1305":   "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
	"ECDHE-ECDSA-AES128-SHA256":     "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256",
	"ECDHE-RSA-AES128-SHA256":       "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256",
	"ECDHE-ECDSA-AES128-SHA":        "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA",
	"ECDHE-RSA-AES128-SHA":          "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
	"ECDHE-ECDSA-AES256-SHA":        "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
	"ECDHE-RSA-AES256-SHA":          "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA",
	"AES128-GCM-SHA256":             "TLS_RSA_WITH_AES_128_GCM_SHA256",
	"AES256-GCM-SHA384":             "TLS_RSA_WITH_AES_256_GCM_SHA384",
	"AES128-SHA256":                 "TLS_RSA_WITH_AES_128_CBC_SHA256",
	"AES128-SHA":                    "TLS_RSA_WITH_AES_128_CBC_SHA",
	"AES256-SHA":                    "TLS_RSA_WITH_AES_256_CBC_SHA",
	"DES-CBC3-SHA":                  "TLS_RSA_WITH_3DES_EDE_CBC_SHA",
}

// IANACiphers maps OpenSSL suite names to IANA names; a name it does not
// know is kept as it is (it then matches no suite: FromNames).
func IANACiphers(openssl []string) []string {
	var out []string
	for _, c := range openssl {
		if n, ok := openSSLToIANA[c]; ok {
			c = n
		}
		out = append(out, c)
	}
	return out
}

// Settings are what a server applies.
type Settings struct {
	MinVersion uint16
	// CipherSuites for TLS 1.0–1.2; nil: Go's defaults.
	CipherSuites []uint16
}

// Default is KubeVirt's and CDI's default: TLS 1.2, Go's suites.
func Default() Settings { return Settings{MinVersion: tls.VersionTLS12} }

// FromNames builds the settings of a minimum version ("VersionTLS12"; an
// unknown one is TLS 1.2) and IANA suite names. No names: Go's suites. Names
// of which none is a TLS 1.0–1.2 suite Go has: TLS 1.3 only.
func FromNames(minVersion string, iana []string) Settings {
	s := Settings{MinVersion: Versions[minVersion]}
	if s.MinVersion == 0 {
		s.MinVersion = tls.VersionTLS12
	}
	if len(iana) == 0 {
		return s
	}
	ids := map[string]uint16{}
	for _, c := range append(tls.CipherSuites(), tls.InsecureCipherSuites()...) {
		ids[c.Name] = c.ID
	}
	for _, n := range iana {
		if id, ok := ids[n]; ok && !slices.Contains(TLS13Ciphers, n) {
			s.CipherSuites = append(s.CipherSuites, id)
		}
	}
	if len(s.CipherSuites) == 0 {
		s.MinVersion = tls.VersionTLS13
	}
	return s
}

// FromKubeVirt reads spec.configuration.tlsConfiguration of kv (nil, or
// none set: Default).
func FromKubeVirt(kv *kubevirtv1.KubeVirt) Settings {
	if kv == nil || kv.Spec.Configuration.TLSConfiguration == nil {
		return Default()
	}
	c := kv.Spec.Configuration.TLSConfiguration
	return FromNames(string(c.MinTLSVersion), c.Ciphers)
}

// FromCDI reads spec.config.tlsSecurityProfile of cdi (nil, or none set:
// Default).
func FromCDI(cdi *cdiv1.CDI) Settings {
	if cdi == nil || cdi.Spec.Config == nil || cdi.Spec.Config.TLSSecurityProfile == nil {
		return Default()
	}
	p := cdi.Spec.Config.TLSSecurityProfile
	var custom *Spec
	if p.Custom != nil {
		custom = &Spec{MinTLSVersion: string(p.Custom.MinTLSVersion), Ciphers: p.Custom.Ciphers}
	}
	typ := string(p.Type)
	if typ == "" && custom != nil {
		typ = Custom
	}
	spec := SpecOf(typ, custom)
	return FromNames(spec.MinTLSVersion, IANACiphers(spec.Ciphers))
}

// Live holds the settings in force for a set of servers. A nil *Live is
// Default.
type Live struct{ cur atomic.Pointer[Settings] }

// NewLive starts at Default.
func NewLive() *Live {
	l := &Live{}
	d := Default()
	l.cur.Store(&d)
	return l
}

// Set replaces the settings; servers apply them from their next handshake.
// It reports whether they changed.
func (l *Live) Set(s Settings) bool {
	old := l.cur.Swap(&s)
	return old == nil || old.MinVersion != s.MinVersion || !slices.Equal(old.CipherSuites, s.CipherSuites)
}

// Get returns the settings in force.
func (l *Live) Get() Settings {
	if l == nil {
		return Default()
	}
	if s := l.cur.Load(); s != nil {
		return *s
	}
	return Default()
}

// Server returns base with the settings applied at every handshake: the
// configuration base (or its GetConfigForClient) gives for a client, with
// the minimum version and suites in force. A nil l returns base unchanged.
func (l *Live) Server(base *tls.Config) *tls.Config {
	if l == nil {
		return base
	}
	fixed := base.Clone()
	fixed.GetConfigForClient = nil
	out := base.Clone()
	out.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
		cfg := fixed
		if base.GetConfigForClient != nil {
			c, err := base.GetConfigForClient(hello)
			if err != nil {
				return nil, err
			}
			if c != nil {
				cfg = c
			}
		}
		cfg = cfg.Clone()
		if len(cfg.NextProtos) == 0 {
			// The protocols an http.Server added to its configuration
			// (h2) go on offering, and HTTP/1.1 with them.
			cfg.NextProtos = slices.Clone(out.NextProtos)
			if len(cfg.NextProtos) > 0 && !slices.Contains(cfg.NextProtos, "http/1.1") {
				cfg.NextProtos = append(cfg.NextProtos, "http/1.1")
			}
		}
		s := l.Get()
		cfg.MinVersion, cfg.CipherSuites = s.MinVersion, slices.Clone(s.CipherSuites)
		if cfg.MaxVersion != 0 && cfg.MaxVersion < cfg.MinVersion {
			cfg.MaxVersion = cfg.MinVersion
		}
		return cfg, nil
	}
	return out
}
