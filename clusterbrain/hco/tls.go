package hco

import (
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
)

// TLS profile types (OpenShift's TLSSecurityProfile).
const (
	TLSProfileOld          = tlsprofile.Old
	TLSProfileIntermediate = tlsprofile.Intermediate
	TLSProfileModern       = tlsprofile.Modern
	TLSProfileCustom       = tlsprofile.Custom
)

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

// profileSpecOf resolves a profile to its minimum version and cipher list
// (OpenSSL names); the KubeVirt CR carries them, the servers that follow it
// apply them (package tlsprofile).
func profileSpecOf(p *hcov1beta1.TLSSecurityProfile) tlsprofile.Spec {
	p = EffectiveTLSProfile(p)
	var custom *tlsprofile.Spec
	if p.Custom != nil {
		custom = &tlsprofile.Spec{MinTLSVersion: p.Custom.MinTLSVersion, Ciphers: p.Custom.Ciphers}
	}
	return tlsprofile.SpecOf(p.Type, custom)
}
