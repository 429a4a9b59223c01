//go:build tools

// Package controlplane records the commands built from the pinned release.
package controlplane

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	// The kubelet test (make test-kubelet) runs a worker node.
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
)
