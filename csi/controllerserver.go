package csi

import (
	"context"
	"errors"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Pagination tokens carry the ID to resume from behind a prefix, so a token
// the driver did not hand out is recognisable.
const (
	volumeTokenPrefix   = "volumes-after:"
	snapshotTokenPrefix = "snapshots-after:"
)

// controllerCapabilities are the controller RPCs this driver implements.
var controllerCapabilities = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
	csi.ControllerServiceCapability_RPC_GET_CAPACITY,
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	csi.ControllerServiceCapability_RPC_GET_VOLUME,
	csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
	csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
}

// ControllerGetCapabilities lists controllerCapabilities.
func (d *Driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	resp := &csi.ControllerGetCapabilitiesResponse{}
	for _, c := range controllerCapabilities {
		resp.Capabilities = append(resp.Capabilities, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}},
		})
	}
	return resp, nil
}

// CreateVolume makes a volume in the requested pool (parameter storagePool),
// empty or copied from a volume or snapshot. A second call with the same
// name returns the same volume if it still fits the request.
func (d *Driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume name is required")
	}
	block, err := checkCapabilities(req.GetVolumeCapabilities())
	if err != nil {
		return nil, err
	}
	d.poolUse.RLock()
	defer d.poolUse.RUnlock()
	p, err := d.poolFor(req.GetParameters())
	if err != nil {
		return nil, err
	}
	if !d.topologyFits(req.GetAccessibilityRequirements()) {
		return nil, status.Errorf(codes.ResourceExhausted, "volumes of node %s cannot satisfy the requested topology", d.cfg.NodeID)
	}

	unlock := d.locks.lock("volume-name/" + req.GetName())
	defer unlock()

	src, err := d.contentSource(req.GetVolumeContentSource(), block)
	if err != nil {
		return nil, err
	}
	if src.unlock != nil {
		defer src.unlock()
	}
	defaultSize := int64(defaultVolumeBytes)
	if src.size > 0 {
		defaultSize = src.size
	}
	size, err := volumeSize(req.GetCapacityRange(), defaultSize, block)
	if err != nil {
		return nil, err
	}
	if size < src.size {
		return nil, status.Errorf(codes.OutOfRange, "requested %d bytes is less than the source's %d bytes", size, src.size)
	}

	if existing, ok := d.volumeByName(req.GetName()); ok {
		if !fitsRange(existing.CapacityBytes, req.GetCapacityRange()) || existing.Block != block ||
			existing.SourceVolumeID != src.volumeID || existing.SourceSnapshotID != src.snapshotID {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists with a different size, access type or source", req.GetName())
		}
		return &csi.CreateVolumeResponse{Volume: d.csiVolume(&existing, req.GetVolumeContentSource())}, nil
	}

	if free := d.poolCapacity(p); size > free {
		return nil, status.Errorf(codes.ResourceExhausted, "pool %s has %d bytes free, %d requested", p.name, free, size)
	}
	v := &volume{
		ID:               newID(),
		Name:             req.GetName(),
		Pool:             p.name,
		CapacityBytes:    size,
		Block:            block,
		SourceVolumeID:   src.volumeID,
		SourceSnapshotID: src.snapshotID,
		CreatedAt:        time.Now().UTC(),
	}
	if err := d.buildVolume(ctx, p, v, src); err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.volumes[v.ID] = v
	d.volumeNames[v.Name] = v.ID
	err = d.savePool(p.name)
	if err != nil {
		delete(d.volumes, v.ID)
		delete(d.volumeNames, v.Name)
	}
	d.mu.Unlock()
	if err != nil {
		_ = d.teardownVolume(p, v)
		return nil, status.Errorf(codes.Internal, "record volume: %v", err)
	}
	d.log.Info("volume created", "volume", v.ID, "name", v.Name, "pool", p.name, "bytes", size, "block", block)
	return &csi.CreateVolumeResponse{Volume: d.csiVolume(v, req.GetVolumeContentSource())}, nil
}

// DeleteVolume removes a volume; a volume that is gone is success.
func (d *Driver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := checkID("volume", id); err != nil {
		return nil, err
	}
	unlock := d.locks.lock("volume/" + id)
	defer unlock()

	d.mu.Lock()
	rec, ok := d.volumes[id]
	var v volume
	if ok {
		v = rec.clone()
	}
	d.mu.Unlock()
	if !ok {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if len(v.Published) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still published at %s", id, strings.Join(sortedKeys(v.Published), ", "))
	}
	p := d.pool(v.Pool)
	if err := d.deactivate(p, &v); err != nil {
		return nil, err
	}
	d.mu.Lock()
	delete(d.volumes, id)
	delete(d.volumeNames, v.Name)
	err := d.savePool(p.name)
	if err != nil {
		d.volumes[id] = rec
		d.volumeNames[v.Name] = id
	}
	d.mu.Unlock()
	if err != nil {
		_ = d.activate(rec, p, nil)
		return nil, status.Errorf(codes.Internal, "forget volume: %v", err)
	}
	if err := os.RemoveAll(p.mountDir(id)); err != nil {
		d.log.Warn("remove mount point", "volume", id, "err", err)
	}
	if err := os.Remove(p.image(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		d.log.Warn("remove volume image", "volume", id, "err", err)
	}
	d.log.Info("volume deleted", "volume", id, "name", v.Name, "pool", p.name)
	return &csi.DeleteVolumeResponse{}, nil
}

// ValidateVolumeCapabilities confirms capabilities that match the volume's
// access type and single-node access modes.
func (d *Driver) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if err := checkID("volume", req.GetVolumeId()); err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume capabilities are required")
	}
	v, err := d.volumeRecord(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	block, err := checkCapabilities(req.GetVolumeCapabilities())
	if err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	if block != v.Block {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: "access type differs from the volume's"}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// ListVolumes pages through the volumes in ID order.
func (d *Driver) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	vols, next, err := d.volumePage(req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for i := range vols {
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: d.csiVolume(&vols[i], nil),
		})
	}
	return resp, nil
}

// volumePage returns up to max volumes (0: all) after the one a starting
// token names, in ID order, and the token of the next page ("" when none).
func (d *Driver) volumePage(token string, max int32) ([]volume, string, error) {
	if max < 0 {
		return nil, "", status.Error(codes.InvalidArgument, "max entries is negative")
	}
	after, err := parseToken(token, volumeTokenPrefix)
	if err != nil {
		return nil, "", err
	}
	d.mu.Lock()
	var vols []volume
	for _, v := range d.volumes {
		if v.ID > after {
			vols = append(vols, v.clone())
		}
	}
	d.mu.Unlock()
	sort.Slice(vols, func(i, j int) bool { return vols[i].ID < vols[j].ID })
	if n := int(max); n > 0 && len(vols) > n {
		return vols[:n], volumeTokenPrefix + vols[n-1].ID, nil
	}
	return vols, "", nil
}

// ControllerGetVolume reports one volume.
func (d *Driver) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	if err := checkID("volume", req.GetVolumeId()); err != nil {
		return nil, err
	}
	v, err := d.volumeRecord(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csi.ControllerGetVolumeResponse{
		Volume: d.csiVolume(&v, nil),
		Status: &csi.ControllerGetVolumeResponse_VolumeStatus{},
	}, nil
}

// GetCapacity reports the bytes still free for new volumes in the requested
// pool: the pool filesystem's free space less what existing volumes may
// still write. Another node's topology has no capacity here.
func (d *Driver) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	if topo := req.GetAccessibleTopology(); topo != nil && !d.topologyMatches(topo) {
		return &csi.GetCapacityResponse{AvailableCapacity: 0}, nil
	}
	block := false
	if len(req.GetVolumeCapabilities()) > 0 {
		var err error
		if block, err = checkCapabilities(req.GetVolumeCapabilities()); err != nil {
			return &csi.GetCapacityResponse{AvailableCapacity: 0}, nil
		}
	}
	p, err := d.poolFor(req.GetParameters())
	if err != nil {
		return nil, err
	}
	free := d.poolCapacity(p)
	return &csi.GetCapacityResponse{
		AvailableCapacity: free,
		MaximumVolumeSize: wrapperspb.Int64(free),
		MinimumVolumeSize: wrapperspb.Int64(minVolumeBytes(block)),
	}, nil
}

// ControllerExpandVolume grows the image, the loop devices and, when it
// can, the filesystem; a filesystem that must grow online without the
// capability to do so is left to NodeExpandVolume.
func (d *Driver) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := checkID("volume", id); err != nil {
		return nil, err
	}
	if req.GetCapacityRange() == nil {
		return nil, status.Error(codes.InvalidArgument, "capacity range is required")
	}
	unlock := d.locks.lock("volume/" + id)
	defer unlock()
	v, err := d.volumeRecord(id)
	if err != nil {
		return nil, err
	}
	size, err := volumeSize(req.GetCapacityRange(), v.CapacityBytes, v.Block)
	if err != nil {
		return nil, err
	}
	if size <= v.CapacityBytes {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes}, nil
	}
	p := d.pool(v.Pool)
	if free := d.poolCapacity(p); size-v.CapacityBytes > free {
		return nil, status.Errorf(codes.ResourceExhausted, "pool %s has %d bytes free, %d more requested", p.name, free, size-v.CapacityBytes)
	}
	if err := d.growVolume(p, &v, size); err != nil {
		return nil, err
	}
	nodeStep := false
	fsBytes := v.FilesystemBytes
	if !v.Block {
		err := d.growFilesystem(ctx, p, &v)
		switch {
		case errors.Is(err, errNeedsOnlineResize):
			nodeStep = true
		case err != nil:
			return nil, status.Errorf(codes.Internal, "expand volume %s: %v", id, err)
		default:
			fsBytes = size
		}
	}
	d.mu.Lock()
	if rec, ok := d.volumes[id]; ok {
		rec.CapacityBytes = size
		rec.FilesystemBytes = fsBytes
	}
	err = d.savePool(p.name)
	d.mu.Unlock()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "record new size: %v", err)
	}
	d.log.Info("volume expanded", "volume", id, "bytes", size, "nodeStep", nodeStep)
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: nodeStep}, nil
}

// CreateSnapshot copies a volume's image (its filesystem frozen meanwhile)
// into the volume's pool.
func (d *Driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot name is required")
	}
	srcID := req.GetSourceVolumeId()
	if err := checkID("source volume", srcID); err != nil {
		return nil, err
	}
	if !d.topologyFits(req.GetAccessibilityRequirements()) {
		return nil, status.Errorf(codes.ResourceExhausted, "snapshots of node %s cannot satisfy the requested topology", d.cfg.NodeID)
	}
	unlock := d.locks.lock("snapshot-name/" + req.GetName())
	defer unlock()

	d.mu.Lock()
	existingID, exists := d.snapshotNames[req.GetName()]
	var existing snapshot
	if exists {
		existing = *d.snapshots[existingID]
	}
	d.mu.Unlock()
	if exists {
		if existing.SourceVolumeID != srcID {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %q exists for another source volume", req.GetName())
		}
		return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(&existing)}, nil
	}

	unlockSrc := d.locks.lock("volume/" + srcID)
	defer unlockSrc()
	v, err := d.volumeRecord(srcID)
	if err != nil {
		return nil, err
	}
	p := d.pool(v.Pool)
	s := &snapshot{
		ID:             newID(),
		Name:           req.GetName(),
		Pool:           p.name,
		SourceVolumeID: srcID,
		SizeBytes:      v.CapacityBytes,
		Block:          v.Block,
		CreatedAt:      time.Now().UTC(),
	}
	if err := d.copyVolumeImage(p, &v, p.snapImage(s.ID)); err != nil {
		return nil, status.Errorf(codes.Internal, "snapshot volume %s: %v", srcID, err)
	}
	d.mu.Lock()
	d.snapshots[s.ID] = s
	d.snapshotNames[s.Name] = s.ID
	err = d.savePool(p.name)
	if err != nil {
		delete(d.snapshots, s.ID)
		delete(d.snapshotNames, s.Name)
	}
	d.mu.Unlock()
	if err != nil {
		_ = os.Remove(p.snapImage(s.ID))
		return nil, status.Errorf(codes.Internal, "record snapshot: %v", err)
	}
	d.log.Info("snapshot created", "snapshot", s.ID, "name", s.Name, "volume", srcID, "pool", p.name)
	return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(s)}, nil
}

// DeleteSnapshot removes a snapshot; one that is gone is success.
func (d *Driver) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if err := checkID("snapshot", id); err != nil {
		return nil, err
	}
	unlock := d.locks.lock("snapshot/" + id)
	defer unlock()
	d.mu.Lock()
	s, ok := d.snapshots[id]
	if !ok {
		d.mu.Unlock()
		return &csi.DeleteSnapshotResponse{}, nil
	}
	delete(d.snapshots, id)
	delete(d.snapshotNames, s.Name)
	err := d.savePool(s.Pool)
	if err != nil {
		d.snapshots[id] = s
		d.snapshotNames[s.Name] = id
	}
	d.mu.Unlock()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "forget snapshot: %v", err)
	}
	if err := os.Remove(d.pool(s.Pool).snapImage(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		d.log.Warn("remove snapshot image", "snapshot", id, "err", err)
	}
	d.log.Info("snapshot deleted", "snapshot", id, "name", s.Name)
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots pages through snapshots in ID order, optionally filtered by
// snapshot or source volume.
func (d *Driver) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max entries is negative")
	}
	after, err := parseToken(req.GetStartingToken(), snapshotTokenPrefix)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	var snaps []snapshot
	for _, s := range d.snapshots {
		if s.ID <= after ||
			(req.GetSnapshotId() != "" && s.ID != req.GetSnapshotId()) ||
			(req.GetSourceVolumeId() != "" && s.SourceVolumeID != req.GetSourceVolumeId()) {
			continue
		}
		snaps = append(snaps, *s)
	}
	d.mu.Unlock()
	sort.Slice(snaps, func(i, j int) bool { return snaps[i].ID < snaps[j].ID })

	resp := &csi.ListSnapshotsResponse{}
	if n := int(req.GetMaxEntries()); n > 0 && len(snaps) > n {
		snaps = snaps[:n]
		resp.NextToken = snapshotTokenPrefix + snaps[n-1].ID
	}
	for i := range snaps {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: d.csiSnapshot(&snaps[i])})
	}
	return resp, nil
}

// GetSnapshot reports one snapshot.
func (d *Driver) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if err := checkID("snapshot", id); err != nil {
		return nil, err
	}
	d.mu.Lock()
	s, ok := d.snapshots[id]
	var c snapshot
	if ok {
		c = *s
	}
	d.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", id)
	}
	return &csi.GetSnapshotResponse{Snapshot: d.csiSnapshot(&c)}, nil
}

func (d *Driver) csiVolume(v *volume, source *csi.VolumeContentSource) *csi.Volume {
	return &csi.Volume{
		VolumeId:           v.ID,
		CapacityBytes:      v.CapacityBytes,
		VolumeContext:      map[string]string{ParamStoragePool: v.Pool},
		ContentSource:      source,
		AccessibleTopology: []*csi.Topology{d.topology()},
	}
}

func (d *Driver) csiSnapshot(s *snapshot) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:     s.ID,
		SourceVolumeId: s.SourceVolumeID,
		SizeBytes:      s.SizeBytes,
		CreationTime:   timestamppb.New(s.CreatedAt),
		ReadyToUse:     true,
	}
}

func (d *Driver) topology() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{TopologyKey: d.cfg.NodeID}}
}

// topologyMatches reports whether t names this node (segments other than
// the topology key do not restrict).
func (d *Driver) topologyMatches(t *csi.Topology) bool {
	node, ok := t.GetSegments()[TopologyKey]
	return !ok || node == d.cfg.NodeID
}

// topologyFits reports whether this node satisfies the requisite topology.
func (d *Driver) topologyFits(req *csi.TopologyRequirement) bool {
	if len(req.GetRequisite()) == 0 {
		return true
	}
	for _, t := range req.GetRequisite() {
		if d.topologyMatches(t) {
			return true
		}
	}
	return false
}

// poolFor picks the pool named by the storagePool parameter, or the default.
func (d *Driver) poolFor(params map[string]string) (*pool, error) {
	name := params[ParamStoragePool]
	if name == "" {
		name = d.cfg.DefaultPool
	}
	p := d.pool(name)
	if p == nil {
		return nil, status.Errorf(codes.InvalidArgument, "storage pool %q does not exist on node %s", name, d.cfg.NodeID)
	}
	return p, nil
}

// volumeRecord returns a copy of a volume's record or NotFound.
func (d *Driver) volumeRecord(id string) (volume, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.volumes[id]
	if !ok {
		return volume{}, status.Errorf(codes.NotFound, "volume %s does not exist", id)
	}
	return v.clone(), nil
}

func (d *Driver) volumeByName(name string) (volume, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	id, ok := d.volumeNames[name]
	if !ok {
		return volume{}, false
	}
	return d.volumes[id].clone(), true
}

// checkID rejects empty and malformed IDs with InvalidArgument.
func checkID(what, id string) error {
	if id == "" {
		return status.Errorf(codes.InvalidArgument, "%s id is required", what)
	}
	if !validID(id) {
		return status.Errorf(codes.InvalidArgument, "%s id %q is not valid", what, id)
	}
	return nil
}

func parseToken(token, prefix string) (string, error) {
	if token == "" {
		return "", nil
	}
	after, ok := strings.CutPrefix(token, prefix)
	if !ok || !validID(after) {
		return "", status.Errorf(codes.Aborted, "starting token %q was not issued by this driver", token)
	}
	return after, nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
