package csi

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// nodeCapabilities are the node RPCs this driver implements. There is no
// stage step: volumes are already mounted (or attached) in their pool.
var nodeCapabilities = []csi.NodeServiceCapability_RPC_Type{
	csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
	csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
	csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
	csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH,
}

// NodeGetCapabilities lists nodeCapabilities.
func (d *Driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	resp := &csi.NodeGetCapabilitiesResponse{}
	for _, c := range nodeCapabilities {
		resp.Capabilities = append(resp.Capabilities, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: c}},
		})
	}
	return resp, nil
}

// NodeGetInfo reports the node name, its topology and the volume limit.
func (d *Driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             d.cfg.NodeID,
		MaxVolumesPerNode:  d.cfg.MaxVolumesPerNode,
		AccessibleTopology: d.topology(),
	}, nil
}

// NodePublishVolume bind-mounts the volume's filesystem (or its loop
// device) at the target path. A read-only publish of a filesystem is a
// read-only bind mount; of a block volume, a read-only loop device.
func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := checkID("volume", id); err != nil {
		return nil, err
	}
	if req.GetTargetPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "target path is required")
	}
	if !filepath.IsAbs(req.GetTargetPath()) {
		return nil, status.Errorf(codes.InvalidArgument, "target path %q is not absolute", req.GetTargetPath())
	}
	if req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume capability is required")
	}
	capability := req.GetVolumeCapability()
	block, err := checkCapabilities([]*csi.VolumeCapability{capability})
	if err != nil {
		return nil, err
	}
	target := filepath.Clean(req.GetTargetPath())
	mode := capability.GetAccessMode().GetMode()
	pub := publication{
		ReadOnly:     req.GetReadonly() || mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		SingleWriter: mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
	}

	unlock := d.locks.lock("volume/" + id)
	defer unlock()
	v, err := d.volumeRecord(id)
	if err != nil {
		return nil, err
	}
	if block != v.Block {
		return nil, status.Errorf(codes.InvalidArgument, "volume %s was not created for this access type", id)
	}
	if old, ok := v.Published[target]; ok {
		if mounted, _ := isMountpoint(target); mounted {
			if old.ReadOnly != pub.ReadOnly {
				return nil, status.Errorf(codes.AlreadyExists, "volume %s is published at %s with another read-only setting", id, target)
			}
			return &csi.NodePublishVolumeResponse{}, nil
		}
	}
	for other, o := range v.Published {
		if other == target || o.ReadOnly && !pub.SingleWriter {
			continue
		}
		if (pub.SingleWriter && !pub.ReadOnly) || (o.SingleWriter && !o.ReadOnly) {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s has a single writer and is already published at %s", id, other)
		}
	}

	p := d.pool(v.Pool)
	if block {
		pub.Device, err = d.publishBlock(p, &v, target, pub.ReadOnly)
	} else {
		err = d.publishFilesystem(p, &v, target, pub.ReadOnly, capability.GetMount().GetMountFlags())
	}
	if err != nil {
		return nil, err
	}

	d.mu.Lock()
	rec := d.volumes[id]
	if rec.Published == nil {
		rec.Published = map[string]publication{}
	}
	rec.Published[target] = pub
	if v.dev != "" {
		rec.dev = v.dev
	}
	err = d.savePool(p.name)
	if err != nil {
		delete(rec.Published, target)
	}
	d.mu.Unlock()
	if err != nil {
		_ = unmountIfMounted(target)
		if pub.Device != "" {
			_ = detachLoop(pub.Device)
		}
		return nil, status.Errorf(codes.Internal, "record publication: %v", err)
	}
	d.log.Info("volume published", "volume", id, "target", target, "readOnly", pub.ReadOnly)
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d *Driver) publishFilesystem(p *pool, v *volume, target string, readOnly bool, flags []string) error {
	bits, err := mountFlags(flags)
	if err != nil {
		return err
	}
	if readOnly {
		bits |= unix.MS_RDONLY
	}
	dir := p.mountDir(v.ID)
	if err := mountImage(p.image(v.ID), dir); err != nil {
		return status.Errorf(codes.Internal, "volume %s: %v", v.ID, err)
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return status.Errorf(codes.Internal, "create target: %v", err)
	}
	if mounted, err := isMountpoint(target); err != nil || mounted {
		return status.Errorf(codes.FailedPrecondition, "target %s is already a mount point (%v)", target, err)
	}
	if err := bindMount(dir, target, bits); err != nil {
		return status.Errorf(codes.Internal, "publish volume %s: %v", v.ID, err)
	}
	return nil
}

// publishBlock binds the volume's device onto a file at target and returns
// the read-only loop device it made, if any.
func (d *Driver) publishBlock(p *pool, v *volume, target string, readOnly bool) (string, error) {
	img := p.image(v.ID)
	if v.dev == "" || loopBacking(v.dev) != img {
		if err := d.activate(v, p, nil); err != nil {
			return "", status.Errorf(codes.Internal, "volume %s: %v", v.ID, err)
		}
	}
	src, roDev := v.dev, ""
	if readOnly {
		dev, err := attachLoop(img, true)
		if err != nil {
			return "", status.Errorf(codes.Internal, "volume %s: %v", v.ID, err)
		}
		src, roDev = dev, dev
	}
	fail := func(code codes.Code, err error) (string, error) {
		if roDev != "" {
			_ = detachLoop(roDev)
		}
		return "", status.Errorf(code, "publish volume %s: %v", v.ID, err)
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return fail(codes.Internal, err)
	}
	f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fail(codes.Internal, err)
	}
	f.Close()
	if mounted, err := isMountpoint(target); err != nil || mounted {
		return fail(codes.FailedPrecondition, errors.New("target is already a mount point"))
	}
	if err := bindMount(src, target, 0); err != nil {
		return fail(codes.Internal, err)
	}
	return roDev, nil
}

// NodeUnpublishVolume unmounts and removes the target; a target that is not
// mounted is success.
func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := checkID("volume", id); err != nil {
		return nil, err
	}
	if req.GetTargetPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "target path is required")
	}
	target := filepath.Clean(req.GetTargetPath())
	unlock := d.locks.lock("volume/" + id)
	defer unlock()
	v, err := d.volumeRecord(id)
	if err != nil {
		return nil, err
	}
	if err := unmountIfMounted(target); err != nil {
		return nil, status.Errorf(codes.Internal, "unpublish volume %s: %v", id, err)
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "remove target: %v", err)
	}
	pub, ok := v.Published[target]
	if !ok {
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if pub.Device != "" && loopBacking(pub.Device) == d.pool(v.Pool).image(id) {
		if err := detachLoop(pub.Device); err != nil {
			return nil, status.Errorf(codes.Internal, "unpublish volume %s: %v", id, err)
		}
	}
	d.mu.Lock()
	delete(d.volumes[id].Published, target)
	err = d.savePool(v.Pool)
	d.mu.Unlock()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "record unpublication: %v", err)
	}
	d.log.Info("volume unpublished", "volume", id, "target", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// NodeGetVolumeStats reports the real usage of a published volume: bytes
// and inodes of its filesystem, or the size of its device.
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id := req.GetVolumeId()
	if err := checkID("volume", id); err != nil {
		return nil, err
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path is required")
	}
	v, path, err := d.nodeVolume(id, req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	if v.Block {
		size, err := deviceSize(path)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
		}
		return &csi.NodeGetVolumeStatsResponse{
			Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}},
		}, nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: statfs: %v", id, err)
	}
	bs := st.Bsize
	return &csi.NodeGetVolumeStatsResponse{
		Usage: []*csi.VolumeUsage{
			{
				Unit:      csi.VolumeUsage_BYTES,
				Total:     int64(st.Blocks) * bs,
				Available: int64(st.Bavail) * bs,
				Used:      int64(st.Blocks-st.Bfree) * bs,
			},
			{
				Unit:      csi.VolumeUsage_INODES,
				Total:     int64(st.Files),
				Available: int64(st.Ffree),
				Used:      int64(st.Files - st.Ffree),
			},
		},
	}, nil
}

// NodeExpandVolume grows the filesystem to the (already grown) image when
// the controller step could not; otherwise there is nothing to do.
func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := checkID("volume", id); err != nil {
		return nil, err
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path is required")
	}
	unlock := d.locks.lock("volume/" + id)
	defer unlock()
	v, _, err := d.nodeVolume(id, req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	if c := req.GetVolumeCapability(); c != nil {
		block, err := checkCapabilities([]*csi.VolumeCapability{c})
		if err != nil {
			return nil, err
		}
		if block != v.Block {
			return nil, status.Errorf(codes.InvalidArgument, "volume %s was not created for this access type", id)
		}
	}
	if r := req.GetCapacityRange().GetRequiredBytes(); r > v.CapacityBytes {
		return nil, status.Errorf(codes.OutOfRange, "volume %s holds %d bytes; expand it through the controller first", id, v.CapacityBytes)
	}
	if v.Block || v.FilesystemBytes >= v.CapacityBytes {
		return &csi.NodeExpandVolumeResponse{CapacityBytes: v.CapacityBytes}, nil
	}
	err = d.growFilesystem(ctx, d.pool(v.Pool), &v)
	if errors.Is(err, errNeedsOnlineResize) {
		return nil, status.Errorf(codes.FailedPrecondition, "expand volume %s: %v; unpublish it and retry", id, err)
	}
	if err != nil {
		return nil, status.Errorf(codes.Internal, "expand volume %s: %v", id, err)
	}
	d.mu.Lock()
	if rec, ok := d.volumes[id]; ok {
		rec.FilesystemBytes = v.CapacityBytes
	}
	err = d.savePool(v.Pool)
	d.mu.Unlock()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "record new size: %v", err)
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: v.CapacityBytes}, nil
}

// nodeVolume resolves a volume and a path it is published at (or its own
// mount point); a path that does not hold the volume is NotFound.
func (d *Driver) nodeVolume(id, path string) (volume, string, error) {
	v, err := d.volumeRecord(id)
	if err != nil {
		return volume{}, "", err
	}
	path = filepath.Clean(path)
	p := d.pool(v.Pool)
	_, published := v.Published[path]
	own := (!v.Block && path == p.mountDir(id)) || (v.Block && path == v.dev)
	if !published && !own {
		return volume{}, "", status.Errorf(codes.NotFound, "volume %s is not published at %s", id, path)
	}
	if mounted, err := isMountpoint(path); !own && (err != nil || !mounted) {
		return volume{}, "", status.Errorf(codes.NotFound, "volume %s is no longer mounted at %s", id, path)
	}
	return v, path, nil
}

// deviceSize is the size of the block device at path.
func deviceSize(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	// Seeking to the end of a block device yields its size.
	return f.Seek(0, io.SeekEnd)
}
