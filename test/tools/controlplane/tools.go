//go:build tools

// Package controlplane records the commands built from the pinned release.
package controlplane

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
)
