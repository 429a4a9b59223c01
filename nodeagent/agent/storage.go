package agent

import (
	"context"

	"github.com/nodevirt/nodevirt/nodeagent/provisioner"
)

// csiRole serves the node's CSI driver on its socket.
type csiRole struct{ d *Deps }

func (r csiRole) Name() string                  { return "csi" }
func (r csiRole) Run(ctx context.Context) error { return r.d.Volumes.Run(ctx) }

func newCSIRole(d *Deps) (Role, error) { return csiRole{d}, nil }

// provisionerRole provisions PersistentVolumes on this node for claims of the
// hostpath storage classes.
type provisionerRole struct{ p *provisioner.Provisioner }

func (r provisionerRole) Name() string                  { return "provisioner" }
func (r provisionerRole) Run(ctx context.Context) error { return r.p.Run(ctx) }

func newProvisionerRole(d *Deps) (Role, error) {
	p, err := provisioner.New(provisioner.Config{NodeName: d.Config.NodeName, Client: d.Kube, Driver: d.Volumes,
		Logger: d.Log.With("role", "provisioner")})
	if err != nil {
		return nil, err
	}
	return provisionerRole{p}, nil
}
