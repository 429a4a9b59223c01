package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/nodevirt/nodevirt/nodeagent/podnet"
)

// podNetworkConfig is the pod network of cfg (defaulted).
func podNetworkConfig(cfg Config) podnet.Config {
	return podnet.Config{Bridge: cfg.PodBridge, CIDR: cfg.PodCIDR, StateDir: filepath.Join(cfg.StateDir, "podnet"),
		Log: cfg.Log.With("role", "pod-network", "node", cfg.NodeName)}
}

// setupPodNetwork builds the node's pod network and sets it up (Ensure).
// A configuration it cannot use is an error; a failed setup is returned as
// ensureErr, and VMIs on the pod network then wait with it in their
// Synchronized condition while the rest of the node works. No network with
// PodCIDR "-".
func setupPodNetwork(cfg Config) (n *podnet.Network, ensureErr, err error) {
	if cfg.PodCIDR == "-" {
		return nil, nil, nil
	}
	n, err = podnet.New(podNetworkConfig(cfg))
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if ensureErr = n.Ensure(ctx); ensureErr != nil {
		cfg.Log.Error("pod network setup failed: VMIs on the pod network will wait", "node", cfg.NodeName,
			"bridge", cfg.PodBridge, "cidr", cfg.PodCIDR, "err", ensureErr)
	}
	return n, ensureErr, nil
}

// newPodNetworkRole serves DHCP on the pod network; nothing when the node
// has none or its setup failed.
func newPodNetworkRole(d *Deps) (Role, error) {
	if d.PodNetwork == nil || d.PodNetworkErr != nil {
		return namedRole{"pod-network", func(context.Context) error { return nil }}, nil
	}
	return namedRole{"pod-network", d.PodNetwork.Run}, nil
}

// TeardownPodNetwork removes the pod network cfg describes (its bridge,
// remaining taps, nftables tables, the ip_forward switch it turned on, its
// state): for uninstalling (`nodeagent --teardown-podnet`, run by
// `make lab-down`), never while guests should keep their network. What is
// already gone is success.
func TeardownPodNetwork(ctx context.Context, cfg Config) error {
	cfg.defaults()
	if cfg.PodCIDR == "-" {
		return nil
	}
	n, err := podnet.New(podNetworkConfig(cfg))
	if err != nil {
		return fmt.Errorf("pod network: %w", err)
	}
	return n.Teardown(ctx)
}
