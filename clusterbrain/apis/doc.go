// Package apis holds the custom resources of OpenShift Virtualization's
// operators that have no light upstream Go module (HyperConverged,
// NetworkAddonsConfig, HostPathProvisioner, SSP), defined with the same JSON
// shape as upstream so existing manifests apply unchanged. KubeVirt and CDI
// types come from kubevirt.io/api and kubevirt.io/containerized-data-importer-api.
//
// These objects are few and small, so their DeepCopy is a JSON round trip
// (see deepCopyJSON) rather than generated code.
package apis

import "encoding/json"

// DeepCopyJSON copies in into out through JSON. Both must be pointers to
// the same type.
func DeepCopyJSON(in, out any) {
	data, err := json.Marshal(in)
	if err != nil {
		panic(err) // API types always marshal
	}
	if err := json.Unmarshal(data, out); err != nil {
		panic(err)
	}
}
