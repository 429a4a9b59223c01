package agent

import (
	"context"

	"github.com/nodevirt/nodevirt/nodeagent/provisioner"
)

// namedRole adapts a Run function to Role.
type namedRole struct {
	name string
	run  func(context.Context) error
}

func (r namedRole) Name() string                  { return r.name }
func (r namedRole) Run(ctx context.Context) error { return r.run(ctx) }

// newCSIRole serves the node's CSI driver on its socket.
func newCSIRole(d *Deps) (Role, error) { return namedRole{"csi", d.Volumes.Run}, nil }

// newProvisionerRole provisions PersistentVolumes on this node for claims of
// the hostpath storage classes.
func newProvisionerRole(d *Deps) (Role, error) {
	p, err := provisioner.New(provisioner.Config{NodeName: d.Config.NodeName, Client: d.Kube, Driver: d.Volumes,
		Logger: d.Log.With("role", "provisioner")})
	if err != nil {
		return nil, err
	}
	return namedRole{"provisioner", p.Run}, nil
}
