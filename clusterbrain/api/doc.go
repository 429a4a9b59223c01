// Package api holds the custom resources of OpenShift Virtualization's
// operators that have no light upstream Go module (HyperConverged,
// NetworkAddonsConfig, HostPathProvisioner, SSP), defined with the same JSON
// shape as upstream so existing manifests apply unchanged. KubeVirt and CDI
// types come from kubevirt.io/api and kubevirt.io/containerized-data-importer-api.
//
// These objects are few and small, so their DeepCopy is a JSON round trip
// (see DeepCopyJSON) rather than generated code.
//
// # Where the shared contracts live
//
// clusterbrain/api/... is the home of what both daemons (the brain and the
// node agent) and the clients speak: API types (these, volumesnapshot/v1,
// macpool/v1alpha1), the typed client (client), the PVC import protocol
// (importstate), the daemons' identities and certificate names (identity),
// the fencing timeline (fencing), feature gate names (featuregate) and the
// plain websocket framing of consoles (plainstream).
//
// clusterbrain/kit/... holds plumbing both daemons share that is no
// contract: daemon lifecycle and build stamps (daemon, daemon/buildinfo),
// PKI helpers (certs, uploadtls) and the metrics registry (metrics).
//
// The import rule, checked by this package's tests with `go list -deps`:
// the node side (nodeagent, launcher, csi, cni) reaches no clusterbrain
// package outside api/... and kit/...; the brain reaches nothing of the
// node side; and api/... and kit/... import no other nodevirt package, so
// a change in either daemon's roles never recompiles the other daemon.
package api

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
