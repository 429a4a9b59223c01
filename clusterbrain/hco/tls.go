package hco

import (
	"crypto/tls"
	"slices"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// TLS profile types (OpenShift's TLSSecurityProfile).
const (
	TLSProfileOld          = "Old"
	TLSProfileIntermediate = "Intermediate"
	TLSProfileModern       = "Modern"
	TLSProfileCustom       = "Custom"
)

// TLS protocol versions as the profile spells them.
var tlsVersions = map[string]uint16{
	"VersionTLS10": tls.VersionTLS10,
	"VersionTLS11": tls.VersionTLS11,
	"VersionTLS12": tls.VersionTLS12,
	"VersionTLS13": tls.VersionTLS13,
}

var tls13Ciphers = []string{"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}

var intermediateCiphers = append(append([]string{}, tls13Ciphers...),
	"ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
	"ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
	"ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
	"DHE-RSA-AES128-GCM-SHA256", "DHE-RSA-AES256-GCM-SHA384")

var oldCiphers = append(append([]string{}, intermediateCiphers...),
	"DHE-RSA-CHACHA20-POLY1305",
	"ECDHE-ECDSA-AES128-SHA256", "ECDHE-RSA-AES128-SHA256", "ECDHE-ECDSA-AES128-SHA", "ECDHE-RSA-AES128-SHA",
	"ECDHE-ECDSA-AES256-SHA384", "ECDHE-RSA-AES256-SHA384", "ECDHE-ECDSA-AES256-SHA", "ECDHE-RSA-AES256-SHA",
	"DHE-RSA-AES128-SHA256", "DHE-RSA-AES256-SHA256",
	"AES128-GCM-SHA256", "AES256-GCM-SHA384", "AES128-SHA256", "AES256-SHA256", "AES128-SHA", "AES256-SHA",
	"DES-CBC3-SHA")

// profileSpec is what a predefined profile stands for.
type profileSpec struct {
	MinTLSVersion string
	Ciphers       []string // OpenSSL names
}

var predefinedProfiles = map[string]profileSpec{
	TLSProfileOld:          {"VersionTLS10", oldCiphers},
	TLSProfileIntermediate: {"VersionTLS12", intermediateCiphers},
	TLSProfileModern:       {"VersionTLS13", tls13Ciphers},
}

// openSSLToIANA names the cipher suites Go implements by their OpenSSL
// names; TLS 1.3 suites keep their IANA names in both.
var openSSLToIANA = map[string]string{
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

// EffectiveTLSProfile returns the profile in force: the HCO's, or
// Intermediate when none is set (as upstream on a cluster without an
// APIServer TLS profile). The result always has its type set.
func EffectiveTLSProfile(p *hcov1beta1.TLSSecurityProfile) *hcov1beta1.TLSSecurityProfile {
	if p == nil || p.Type == "" && p.Custom == nil {
		return &hcov1beta1.TLSSecurityProfile{Type: TLSProfileIntermediate, Intermediate: &struct{}{}}
	}
	out := *p
	if out.Type == "" {
		out.Type = TLSProfileCustom
	}
	return &out
}

// profileSpecOf resolves a profile to its minimum version and cipher list.
func profileSpecOf(p *hcov1beta1.TLSSecurityProfile) profileSpec {
	p = EffectiveTLSProfile(p)
	if p.Type == TLSProfileCustom && p.Custom != nil {
		return profileSpec{MinTLSVersion: p.Custom.MinTLSVersion, Ciphers: p.Custom.Ciphers}
	}
	if spec, ok := predefinedProfiles[p.Type]; ok {
		return spec
	}
	return predefinedProfiles[TLSProfileIntermediate]
}

// ianaCiphers maps OpenSSL cipher names to IANA names, dropping names Go
// does not implement.
func ianaCiphers(openssl []string) []string {
	var out []string
	for _, c := range openssl {
		if n, ok := openSSLToIANA[c]; ok {
			out = append(out, n)
		}
	}
	return out
}

// GoTLS turns a profile into crypto/tls settings for nodevirt's own servers:
// the minimum version and the TLS 1.2 cipher suites (Go does not let TLS 1.3
// suites be chosen).
func GoTLS(p *hcov1beta1.TLSSecurityProfile) (minVersion uint16, suites []uint16) {
	spec := profileSpecOf(p)
	minVersion = tlsVersions[spec.MinTLSVersion]
	if minVersion == 0 {
		minVersion = tls.VersionTLS12
	}
	ids := map[string]uint16{}
	for _, s := range append(tls.CipherSuites(), tls.InsecureCipherSuites()...) {
		ids[s.Name] = s.ID
	}
	for _, name := range ianaCiphers(spec.Ciphers) {
		if id, ok := ids[name]; ok && !slices.Contains(tls13Ciphers, name) {
			suites = append(suites, id)
		}
	}
	return minVersion, suites
}
