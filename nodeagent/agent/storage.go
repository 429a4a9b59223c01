package agent

import (
	"context"
	"fmt"
	"net"
	"path/filepath"

	"k8s.io/client-go/dynamic"

	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport"
	"github.com/nodevirt/nodevirt/nodeagent/provisioner"
	"github.com/nodevirt/nodevirt/nodeagent/snapshotter"
	"github.com/nodevirt/nodevirt/nodeagent/storagepools"
)

// namedRole adapts a Run function to Role.
type namedRole struct {
	name string
	run  func(context.Context) error
}

func (r namedRole) Name() string                  { return r.name }
func (r namedRole) Run(ctx context.Context) error { return r.run(ctx) }

// newStoragePoolsRole opens the HostPathProvisioners' pools for this node
// beside the configured ones (--pools, which win on a name clash) and
// reports them on the Node (package storagepools).
func newStoragePoolsRole(d *Deps) (Role, error) {
	return storagepools.New(storagepools.Config{NodeName: d.Config.NodeName, Kube: d.Kube, HPPs: d.Virt.HostPathProvisioners,
		Driver: d.Volumes, FlagPools: d.Config.Pools, StateFile: filepath.Join(d.Config.StateDir, "storagepools.json"),
		Log: d.Log.With("role", "storage-pools")})
}

// newCSIRole serves the node's CSI driver on its socket.
func newCSIRole(d *Deps) (Role, error) { return namedRole{"csi", d.Volumes.Run}, nil }

// snapshotClient reaches snapshot.storage.k8s.io (CRDs the brain installs
// when the cluster has none).
func snapshotClient(d *Deps) (*snapshotv1.Client, error) {
	dyn, err := dynamic.NewForConfig(d.RestConfig)
	if err != nil {
		return nil, fmt.Errorf("snapshot client: %w", err)
	}
	return snapshotv1.NewClient(dyn), nil
}

// newProvisionerRole provisions PersistentVolumes on this node for claims of
// the hostpath storage classes, restoring VolumeSnapshots this node holds.
func newProvisionerRole(d *Deps) (Role, error) {
	snaps, err := snapshotClient(d)
	if err != nil {
		return nil, err
	}
	p, err := provisioner.New(provisioner.Config{NodeName: d.Config.NodeName, Client: d.Kube, Driver: d.Volumes,
		Snapshots: snaps, Reads: d.Reads, Informers: d.Informers, Logger: d.Log.With("role", "provisioner")})
	if err != nil {
		return nil, err
	}
	return namedRole{"provisioner", p.Run}, nil
}

// newImportRole fills this node's volumes for DataVolumes (HTTP, registry,
// blank, clone) and receives uploads from the brain's upload proxy.
func newImportRole(d *Deps) (Role, error) {
	cfg := dvimport.Config{NodeName: d.Config.NodeName, Kube: d.Kube, Virt: d.Virt, Reads: d.Reads, Informers: d.Informers,
		Resolver: dvimport.CSIResolver(d.Volumes), BrainNamespace: d.Config.BrainNamespace,
		UploadAddr: d.Config.UploadAddr, UploadAdvertiseIP: advertisedIP(d.Config.UploadAddr, d.Config.NodeIP), Log: d.CDILog.With("role", "importer")}
	if d.Cert != nil {
		cfg.UploadTLS, cfg.PeerTLS = d.Cert.ServerTLS(), d.Cert.PeerTLS
	}
	cfg.UploadTLSProfile = d.CDITLS
	a, err := dvimport.New(cfg)
	if err != nil {
		return nil, err
	}
	return namedRole{"importer", a.Run}, nil
}

// newSnapshotterRole takes, binds and deletes the CSI snapshots of this
// node's volumes for VolumeSnapshots (snapshot-controller + csi-snapshotter).
func newSnapshotterRole(d *Deps) (Role, error) {
	snaps, err := snapshotClient(d)
	if err != nil {
		return nil, err
	}
	s, err := snapshotter.New(snapshotter.Config{NodeName: d.Config.NodeName, Kube: d.Kube, Snapshots: snaps,
		Informers: d.Informers, Driver: d.Volumes, Logger: d.Log.With("role", "snapshotter")})
	if err != nil {
		return nil, err
	}
	return namedRole{"snapshotter", s.Run}, nil
}

// advertisedIP is the address to publish for a listener on addr: the node's
// IP when addr binds every address (":8447"), "" (the listener's own) when
// it binds one.
func advertisedIP(addr, nodeIP string) string {
	host, _, err := net.SplitHostPort(addr)
	if ip := net.ParseIP(host); err == nil && (host == "" || ip.IsUnspecified()) {
		return nodeIP
	}
	return ""
}
