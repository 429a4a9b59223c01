package csi

import (
	"context"
	"fmt"
	"os"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// poolAlmostFull is the free fraction below which a pool reports itself
// degraded.
const poolAlmostFull = 0.02

// ControllerGetVolumeHealth reports whether a volume is usable on the node.
func (d *Driver) ControllerGetVolumeHealth(ctx context.Context, req *csi.ControllerGetVolumeHealthRequest) (*csi.ControllerGetVolumeHealthResponse, error) {
	h, err := d.volumeHealthByID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csi.ControllerGetVolumeHealthResponse{VolumeHealth: h}, nil
}

// ControllerListVolumeHealth pages through the health of every volume, in
// the order of ListVolumes.
func (d *Driver) ControllerListVolumeHealth(ctx context.Context, req *csi.ControllerListVolumeHealthRequest) (*csi.ControllerListVolumeHealthResponse, error) {
	vols, next, err := d.volumePage(req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ControllerListVolumeHealthResponse{NextToken: next}
	for i := range vols {
		resp.Entries = append(resp.Entries, d.volumeHealth(&vols[i]))
	}
	return resp, nil
}

// NodeGetVolumeHealth reports whether a volume is usable on this node.
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	h, err := d.volumeHealthByID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: h}, nil
}

// NodeGetStorageHealth reports pools that cannot be reached or are almost
// full; an empty answer means every pool is healthy.
func (d *Driver) NodeGetStorageHealth(ctx context.Context, req *csi.NodeGetStorageHealthRequest) (*csi.NodeGetStorageHealthResponse, error) {
	resp := &csi.NodeGetStorageHealthResponse{}
	for _, name := range d.Pools() {
		p := d.pool(name)
		free, total, err := poolUsage(p.path)
		switch {
		case err != nil:
			resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
				Status:  csi.StorageHealthErrorType_STORAGE_UNREACHABLE,
				Reason:  "PoolUnreachable",
				Message: fmt.Sprintf("pool %s: %v", name, err),
			})
		case total > 0 && float64(free)/float64(total) < poolAlmostFull:
			resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
				Status:  csi.StorageHealthErrorType_STORAGE_DEGRADED,
				Reason:  "PoolAlmostFull",
				Message: fmt.Sprintf("pool %s has %d of %d bytes free", name, free, total),
			})
		}
	}
	return resp, nil
}

func (d *Driver) volumeHealthByID(id string) (*csi.VolumeHealth, error) {
	if err := checkID("volume", id); err != nil {
		return nil, err
	}
	v, err := d.volumeRecord(id)
	if err != nil {
		return nil, err
	}
	return d.volumeHealth(&v), nil
}

// volumeHealth reports a volume inaccessible when its image is missing or
// it is not mounted (or attached) in its pool.
func (d *Driver) volumeHealth(v *volume) *csi.VolumeHealth {
	h := &csi.VolumeHealth{VolumeId: v.ID}
	bad := func(reason, msg string) *csi.VolumeHealth {
		h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: reason, Message: msg,
		})
		return h
	}
	p := d.pool(v.Pool)
	if _, err := os.Stat(p.image(v.ID)); err != nil {
		return bad("ImageMissing", err.Error())
	}
	if v.Block {
		if v.dev == "" || loopBacking(v.dev) != p.image(v.ID) {
			return bad("DeviceDetached", "the volume's loop device is not attached")
		}
		return h
	}
	if mounted, err := isMountpoint(p.mountDir(v.ID)); err != nil || !mounted {
		return bad("NotMounted", "the volume's filesystem is not mounted in its pool")
	}
	return h
}
