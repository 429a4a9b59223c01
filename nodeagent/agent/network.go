package agent

import (
	"github.com/nodevirt/nodevirt/nodeagent/bridgemarker"
)

// newBridgeMarkerRole publishes this node's bridges as
// bridge.network.kubevirt.io/<bridge> resources on its Node.
func newBridgeMarkerRole(d *Deps) (Role, error) {
	m, err := bridgemarker.New(bridgemarker.Config{
		Publisher: &bridgemarker.NodePublisher{Client: d.Kube, NodeName: d.Config.NodeName},
		Log:       d.Log.With("role", "bridge-marker", "node", d.Config.NodeName),
	})
	if err != nil {
		return nil, err
	}
	return namedRole{"bridge-marker", m.Run}, nil
}
