package agent

import "github.com/nodevirt/nodevirt/nodeagent/handler"

// nodeRoles are the node agent's jobs, each in its own package.
var nodeRoles = []RoleFactory{
	newCSIRole,
	newProvisionerRole,
	newBridgeMarkerRole,
	newImportRole,
	newPodNetworkRole,
	newMetricsRole,
	func(d *Deps) (Role, error) {
		cfg := handler.Config{NodeName: d.Config.NodeName, StateDir: d.Config.StateDir + "/vms", LibvirtURI: d.Config.LibvirtURI, Emulation: d.Emulation, Kube: d.Kube, Virt: d.Virt, Volumes: d.Volumes, Console: d.Config.Console, Log: d.Log}
		if d.PodNetwork != nil {
			cfg.PodNetwork, cfg.PodNetworkErr = d.PodNetwork, d.PodNetworkErr
		}
		return handler.New(cfg)
	},
}
