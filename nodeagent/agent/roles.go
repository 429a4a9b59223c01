package agent

import (
	"context"
	"path/filepath"

	"github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/handler"
	"github.com/nodevirt/nodevirt/nodeagent/pluginreg"
)

// nodeRoles are the node agent's jobs, each in its own package.
var nodeRoles = []RoleFactory{
	newStoragePoolsRole, // first: reopens the pools an earlier run took from HostPathProvisioners
	newCSIRole,
	newProvisionerRole,
	newSnapshotterRole,
	newBridgeMarkerRole,
	newImportRole,
	newPodNetworkRole,
	newHandlerRole,
	newMetricsRole, // after the handler: reads statistics over its connections
	newPluginRegistrationRole,
}

// newPluginRegistrationRole registers the CSI driver with the node's
// kubelet, if it has one (package pluginreg); none with KubeletPluginDir "-".
func newPluginRegistrationRole(d *Deps) (Role, error) {
	if d.Config.KubeletPluginDir == "-" {
		return namedRole{"kubelet-plugin-registration", func(ctx context.Context) error { <-ctx.Done(); return nil }}, nil
	}
	return pluginreg.New(pluginreg.Config{Dir: d.Config.KubeletPluginDir, DriverName: csi.DriverName,
		Endpoint: d.Config.CSISocket, Log: d.Log.With("role", "kubelet-plugin-registration")})
}

// NetStateDir is where the agent's bridge plugin keeps its state (the
// bridge locks); the taps themselves are in the handler's per-VM records.
func NetStateDir(stateDir string) string { return filepath.Join(stateDir, "cni") }

// vmStateDir is the handler's state directory (Config.StateDir of package
// handler, as newHandlerRole sets it) in the agent's.
func vmStateDir(stateDir string) string { return filepath.Join(stateDir, "vms") }

// TeardownTaps removes the bridge taps and spoof-check rules of the VMs the
// agent with state directory stateDir recorded, telling each every tap
// (handler.DetachRecordedTaps): for uninstalling after the agent stopped.
func TeardownTaps(ctx context.Context, stateDir string, each func(tap string)) error {
	return handler.DetachRecordedTaps(ctx, vmStateDir(stateDir), NetStateDir(stateDir), each)
}

// newHandlerRole is the virt-handler role: VMIs bound to this node become
// libvirt domains.
func newHandlerRole(d *Deps) (Role, error) {
	cfg := handler.Config{NodeName: d.Config.NodeName, StateDir: filepath.Join(d.Config.StateDir, "vms"),
		LibvirtURI: d.Config.LibvirtURI, Emulation: d.Emulation, Kube: d.Kube, Virt: d.Virt, Reads: d.Reads, Volumes: d.Volumes,
		NetStateDir: NetStateDir(d.Config.StateDir), Console: d.Config.Console, VMIs: d.VMIs, Log: d.Log,
		HostDiskRoot: d.Config.HostDiskRoot, NodeIP: d.Config.NodeIP, MigrationTransport: d.Config.MigrationTransport,
		MigrationPKIDir: d.Config.LibvirtPKIDir}
	if d.Volumes != nil {
		cfg.VolumeMaker = d.Volumes
	}
	if d.PodNetwork != nil {
		cfg.PodNetwork, cfg.PodNetworkErr = d.PodNetwork, d.PodNetworkErr
	}
	h, err := handler.New(cfg)
	if err != nil {
		return nil, err
	}
	d.Handler = h
	return h, nil
}
