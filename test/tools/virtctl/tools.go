//go:build tools

// Package virtctl records the upstream KubeVirt command-line client that the
// compatibility tests build from the pinned release (kubevirt.io/kubevirt's
// cmd/virtctl is a main package, so its library is what is named here).
package virtctl

import (
	_ "kubevirt.io/kubevirt/pkg/virtctl"
)
