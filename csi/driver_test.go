package csi

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

const mib = 1 << 20

func mountCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

const rw = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

type clients struct {
	ctrl csi.ControllerClient
	node csi.NodeClient
}

func newClients(t *testing.T, sock string) clients {
	conn := dial(t, sock)
	return clients{ctrl: csi.NewControllerClient(conn), node: csi.NewNodeClient(conn)}
}

func (c clients) create(t *testing.T, name, pool string, size int64, vc *csi.VolumeCapability) *csi.Volume {
	t.Helper()
	resp, err := c.ctrl.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{vc},
		Parameters:         map[string]string{ParamStoragePool: pool},
	})
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	return resp.GetVolume()
}

func (c clients) publish(t *testing.T, id, target string, vc *csi.VolumeCapability, readOnly bool) {
	t.Helper()
	_, err := c.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: id, TargetPath: target, VolumeCapability: vc, Readonly: readOnly,
	})
	if err != nil {
		t.Fatalf("publish %s at %s: %v", id, target, err)
	}
}

func wantCode(t *testing.T, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want code %s", err, code)
	}
}

// writeFile writes n bytes of non-zero data to path and returns the error.
func writeFile(path string, n int) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	buf := bytes.Repeat([]byte{0xab}, mib)
	for written := 0; written < n; written += len(buf) {
		if _, err := f.Write(buf); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// TestSizeIsEnforced: a 16 MiB filesystem volume reports 16 MiB and refuses
// a 32 MiB write with ENOSPC, while a write that fits succeeds.
func TestSizeIsEnforced(t *testing.T) {
	requireRoot(t)
	d, sock := startDriver(t, testConfig(t))
	c := newClients(t, sock)
	vol := c.create(t, "pvc-quota", "fast", 16*mib, mountCap(rw))
	if vol.GetCapacityBytes() != 16*mib {
		t.Fatalf("capacity %d, want %d", vol.GetCapacityBytes(), 16*mib)
	}
	target := filepath.Join(t.TempDir(), "mnt")
	c.publish(t, vol.GetVolumeId(), target, mountCap(rw), false)

	if err := writeFile(filepath.Join(target, "fits"), 8*mib); err != nil {
		t.Fatalf("write within size: %v", err)
	}
	err := writeFile(filepath.Join(target, "too-big"), 32*mib)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past size: got %v, want ENOSPC", err)
	}

	stats, err := c.node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: target})
	if err != nil {
		t.Fatal(err)
	}
	bytesUsage := stats.GetUsage()[0]
	// ext4 keeps about 1.6 MiB of a 16 MiB filesystem for itself.
	if bytesUsage.GetTotal() > 16*mib || bytesUsage.GetTotal() < 13*mib {
		t.Errorf("stats total %d, want about 16 MiB", bytesUsage.GetTotal())
	}
	if bytesUsage.GetUsed() < 8*mib {
		t.Errorf("stats used %d, want at least the 8 MiB written", bytesUsage.GetUsed())
	}

	if err := os.Remove(filepath.Join(target, "too-big")); err != nil {
		t.Fatal(err)
	}
	disk, isBlock, err := d.VolumeDisk(vol.GetVolumeId())
	if err != nil || isBlock {
		t.Fatalf("VolumeDisk: %s %v %v", disk, isBlock, err)
	}
	if err := writeFile(disk, mib); err != nil {
		t.Fatalf("write disk.img: %v", err)
	}
	if _, err := os.Stat(filepath.Join(target, DiskImageName)); err != nil {
		t.Errorf("disk.img written in-process is not visible in the published volume: %v", err)
	}
}

// TestReadOnlyPublish: a read-only filesystem publish refuses writes, a
// read-write publish of the same volume takes them.
func TestReadOnlyPublish(t *testing.T) {
	requireRoot(t)
	_, sock := startDriver(t, testConfig(t))
	c := newClients(t, sock)
	vol := c.create(t, "pvc-ro", "fast", 16*mib, mountCap(rw))
	dir := t.TempDir()
	roTarget, rwTarget := filepath.Join(dir, "ro"), filepath.Join(dir, "rw")
	c.publish(t, vol.GetVolumeId(), rwTarget, mountCap(rw), false)
	c.publish(t, vol.GetVolumeId(), roTarget, mountCap(rw), true)
	if err := writeFile(filepath.Join(rwTarget, "f"), mib); err != nil {
		t.Fatalf("write through read-write target: %v", err)
	}
	if err := writeFile(filepath.Join(roTarget, "g"), mib); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write through read-only target: got %v, want EROFS", err)
	}
	if _, err := os.Stat(filepath.Join(roTarget, "f")); err != nil {
		t.Fatalf("read-only target does not show the volume's data: %v", err)
	}
	// Publishing the same target again with another read-only setting.
	_, err := c.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: vol.GetVolumeId(), TargetPath: roTarget, VolumeCapability: mountCap(rw), Readonly: false,
	})
	wantCode(t, err, codes.AlreadyExists)
}

// TestBlockVolume: a block volume is a loop device of the requested size,
// published as a device file; writes past its end fail; a read-only
// publish cannot be opened for writing.
func TestBlockVolume(t *testing.T) {
	requireRoot(t)
	d, sock := startDriver(t, testConfig(t))
	c := newClients(t, sock)
	vol := c.create(t, "pvc-block", "slow", 8*mib, blockCap(rw))
	dir := t.TempDir()
	target := filepath.Join(dir, "dev")
	c.publish(t, vol.GetVolumeId(), target, blockCap(rw), false)

	size, err := deviceSize(target)
	if err != nil || size != 8*mib {
		t.Fatalf("published device size %d (%v), want %d", size, err, 8*mib)
	}
	f, err := os.OpenFile(target, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{1}, mib), 7*mib); err != nil {
		t.Errorf("write inside the device: %v", err)
	}
	if n, err := f.WriteAt(bytes.Repeat([]byte{1}, mib), 8*mib); err == nil || n != 0 {
		t.Errorf("write past the device end: wrote %d, err %v; want a failure", n, err)
	}
	f.Close()

	roTarget := filepath.Join(dir, "ro-dev")
	c.publish(t, vol.GetVolumeId(), roTarget, blockCap(rw), true)
	if g, err := os.OpenFile(roTarget, os.O_WRONLY, 0); err == nil {
		_, werr := g.WriteAt([]byte("x"), 0)
		if werr == nil {
			werr = g.Sync()
		}
		g.Close()
		if werr == nil {
			t.Error("read-only block target took a write")
		}
	}

	stats, err := c.node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: target})
	if err != nil || stats.GetUsage()[0].GetTotal() != 8*mib {
		t.Fatalf("block stats %v %v", stats, err)
	}
	disk, isBlock, err := d.VolumeDisk(vol.GetVolumeId())
	if err != nil || !isBlock || !strings.HasPrefix(disk, "/dev/loop") {
		t.Fatalf("VolumeDisk: %s %v %v", disk, isBlock, err)
	}

	for _, tg := range []string{target, roTarget} {
		if _, err := c.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), TargetPath: tg}); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(tg); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("target %s left behind: %v", tg, err)
		}
	}
	if _, err := c.ctrl.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	if backing := loopBacking(disk); backing != "" {
		t.Errorf("loop device %s still attached to %s after delete", disk, backing)
	}
}

// TestPools: volumes land in the pool the StorageClass names, each pool has
// its own state file and capacity, and other nodes' topology gets nothing.
func TestPools(t *testing.T) {
	requireRoot(t)
	cfg := testConfig(t)
	_, sock := startDriver(t, cfg)
	c := newClients(t, sock)
	ctx := context.Background()

	before, err := c.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{ParamStoragePool: "slow"}})
	if err != nil {
		t.Fatal(err)
	}
	fast := c.create(t, "pvc-fast", "fast", 16*mib, mountCap(rw))
	slow := c.create(t, "pvc-slow", "slow", 64*mib, mountCap(rw))
	for _, tc := range []struct {
		vol  *csi.Volume
		pool PoolConfig
	}{{fast, cfg.Pools[0]}, {slow, cfg.Pools[1]}} {
		if _, err := os.Stat(filepath.Join(tc.pool.Path, "volumes", tc.vol.GetVolumeId()+".img")); err != nil {
			t.Errorf("volume image not in pool %s: %v", tc.pool.Name, err)
		}
		state, err := os.ReadFile(filepath.Join(tc.pool.Path, stateFileName))
		if err != nil || !strings.Contains(string(state), tc.vol.GetVolumeId()) {
			t.Errorf("pool %s state does not record its volume: %v", tc.pool.Name, err)
		}
		if tc.vol.GetVolumeContext()[ParamStoragePool] != tc.pool.Name {
			t.Errorf("volume context %v, want pool %s", tc.vol.GetVolumeContext(), tc.pool.Name)
		}
		topo := tc.vol.GetAccessibleTopology()
		if len(topo) != 1 || topo[0].GetSegments()[TopologyKey] != cfg.NodeID {
			t.Errorf("accessible topology %v, want this node", topo)
		}
	}

	after, err := c.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{ParamStoragePool: "slow"}})
	if err != nil {
		t.Fatal(err)
	}
	// The 64 MiB volume is promised: capacity drops by about its size
	// even though the sparse image holds little yet.
	if drop := before.GetAvailableCapacity() - after.GetAvailableCapacity(); drop < 56*mib {
		t.Errorf("capacity dropped by %d after a 64 MiB volume, want about 64 MiB", drop)
	}

	other, err := c.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{
		AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: "node-b"}},
	})
	if err != nil || other.GetAvailableCapacity() != 0 {
		t.Errorf("capacity for another node: %v %v, want 0", other, err)
	}
	_, err = c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-nowhere", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
		Parameters: map[string]string{ParamStoragePool: "missing"},
	})
	wantCode(t, err, codes.InvalidArgument)
	_, err = c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-elsewhere", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{TopologyKey: "node-b"}}}},
	})
	wantCode(t, err, codes.ResourceExhausted)
	_, err = c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-huge", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
		CapacityRange: &csi.CapacityRange{RequiredBytes: after.GetAvailableCapacity() + 1<<30},
	})
	wantCode(t, err, codes.ResourceExhausted)
}

// TestHostileIDs: IDs that could escape a pool directory are refused with
// InvalidArgument by every call that takes one.
func TestHostileIDs(t *testing.T) {
	requireRoot(t)
	_, sock := startDriver(t, testConfig(t))
	c := newClients(t, sock)
	ctx := context.Background()
	target := filepath.Join(t.TempDir(), "t")
	for _, id := range []string{"../../etc", "a/b", "..", ".hidden", "x\x00y", "/abs", strings.Repeat("a", 200), "a b"} {
		calls := map[string]error{}
		_, calls["DeleteVolume"] = c.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		_, calls["ControllerExpandVolume"] = c.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: mib}})
		_, calls["ValidateVolumeCapabilities"] = c.ctrl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)}})
		_, calls["ControllerGetVolume"] = c.ctrl.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
		_, calls["CreateSnapshot"] = c.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: id})
		_, calls["DeleteSnapshot"] = c.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id})
		_, calls["CreateVolume from snapshot"] = c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}},
		})
		_, calls["CreateVolume from volume"] = c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}},
		})
		_, calls["NodePublishVolume"] = c.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: mountCap(rw)})
		_, calls["NodeUnpublishVolume"] = c.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		_, calls["NodeGetVolumeStats"] = c.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
		_, calls["NodeExpandVolume"] = c.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target})
		for call, err := range calls {
			if status.Code(err) != codes.InvalidArgument {
				t.Errorf("%s(%q): got %v, want InvalidArgument", call, id, err)
			}
		}
	}
	// The pool next to the volumes must be untouched.
	if _, err := os.Stat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a hostile call created %s", target)
	}
}

// TestCallLogStripsSecrets: the interceptor logs every call, without the
// secrets the request carried.
func TestCallLogStripsSecrets(t *testing.T) {
	requireRoot(t)
	var buf syncBuffer
	cfg := testConfig(t)
	cfg.Logger = slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	_, sock := startDriver(t, cfg)
	c := newClients(t, sock)
	_, err := c.ctrl.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:               "pvc-secret",
		VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 8 * mib},
		Secrets:            map[string]string{"password": "hunter2-very-secret"},
	})
	if err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	if !strings.Contains(out, "/csi.v1.Controller/CreateVolume") || !strings.Contains(out, "pvc-secret") {
		t.Errorf("call log lacks the call:\n%s", out)
	}
	if strings.Contains(out, "hunter2") {
		t.Errorf("call log leaks a secret:\n%s", out)
	}
}

// TestCloneAndRestore: a clone and a snapshot restore carry the source's
// data and may be larger than the source.
func TestCloneAndRestore(t *testing.T) {
	requireRoot(t)
	d, sock := startDriver(t, testConfig(t))
	c := newClients(t, sock)
	ctx := context.Background()
	src := c.create(t, "pvc-src", "fast", 16*mib, mountCap(rw))
	disk, _, _ := d.VolumeDisk(src.GetVolumeId())
	if err := os.WriteFile(disk, []byte("golden image"), 0o600); err != nil {
		t.Fatal(err)
	}
	snap, err := c.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: src.GetVolumeId()})
	if err != nil {
		t.Fatal(err)
	}
	// Changes after the snapshot do not reach it.
	if err := os.WriteFile(disk, []byte("changed later"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		source *csi.VolumeContentSource
		want   string
	}{
		{"pvc-restored", &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}}, "golden image"},
		{"pvc-clone", &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src.GetVolumeId()}}}, "changed later"},
	} {
		resp, err := c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: tc.name, VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
			CapacityRange:       &csi.CapacityRange{RequiredBytes: 32 * mib},
			VolumeContentSource: tc.source,
			Parameters:          map[string]string{ParamStoragePool: "slow"},
		})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		path, _, _ := d.VolumeDisk(resp.GetVolume().GetVolumeId())
		got, err := os.ReadFile(path)
		if err != nil || string(got) != tc.want {
			t.Errorf("%s: disk holds %q (%v), want %q", tc.name, got, err, tc.want)
		}
		dir, _ := d.VolumePath(resp.GetVolume().GetVolumeId())
		if err := writeFile(filepath.Join(dir, "fill"), 24*mib); err != nil {
			t.Errorf("%s: the copy did not grow to 32 MiB: %v", tc.name, err)
		}
	}
	_, err = c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-too-small", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
		CapacityRange:       &csi.CapacityRange{RequiredBytes: 8 * mib, LimitBytes: 8 * mib},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src.GetVolumeId()}}},
	})
	wantCode(t, err, codes.OutOfRange)
}

// TestExpandFilesystem: after ControllerExpandVolume the filesystem takes
// writes up to the new size.
func TestExpandFilesystem(t *testing.T) {
	requireRoot(t)
	d, sock := startDriver(t, testConfig(t))
	c := newClients(t, sock)
	ctx := context.Background()
	vol := c.create(t, "pvc-grow", "fast", 16*mib, mountCap(rw))
	dir, _ := d.VolumePath(vol.GetVolumeId())
	if err := writeFile(filepath.Join(dir, "a"), 24*mib); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("24 MiB into 16 MiB: got %v, want ENOSPC", err)
	}
	resp, err := c.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
		VolumeId: vol.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 48 * mib},
	})
	if err != nil || resp.GetCapacityBytes() != 48*mib || resp.GetNodeExpansionRequired() {
		t.Fatalf("expand: %v %v", resp, err)
	}
	if err := writeFile(filepath.Join(dir, "a"), 24*mib); err != nil {
		t.Fatalf("24 MiB after growing to 48 MiB: %v", err)
	}
}
