package agent

import (
	"context"

	"github.com/nodevirt/nodevirt/nodeagent/dvimport"
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

// newImportRole fills this node's volumes for DataVolumes (HTTP, registry,
// blank, clone) and receives uploads from the brain's upload proxy.
func newImportRole(d *Deps) (Role, error) {
	cfg := dvimport.Config{NodeName: d.Config.NodeName, Kube: d.Kube, Virt: d.Virt,
		Resolver: dvimport.CSIResolver(d.Volumes), BrainNamespace: d.Config.BrainNamespace,
		UploadAddr: d.Config.UploadAddr, Log: d.Log.With("role", "importer")}
	if d.Cert != nil {
		cfg.UploadTLS, cfg.PeerTLS = d.Cert.ServerTLS(), d.Cert.PeerTLS
	}
	a, err := dvimport.New(cfg)
	if err != nil {
		return nil, err
	}
	return namedRole{"importer", a.Run}, nil
}
