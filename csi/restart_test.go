package csi

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
)

// syncBuffer is a bytes.Buffer safe for concurrent log writes.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestRestartKeepsEverything: a restarted driver (same process state on
// the node) and a driver after a simulated reboot (mounts and loop devices
// gone) both find every volume, snapshot and byte again; leftovers of an
// interrupted create are removed.
func TestRestartKeepsEverything(t *testing.T) {
	requireRoot(t)
	cfg := testConfig(t)
	ctx := context.Background()
	d1, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	createReq := func(name string, vc *csi.VolumeCapability) *csi.CreateVolumeRequest {
		return &csi.CreateVolumeRequest{
			Name: name, VolumeCapabilities: []*csi.VolumeCapability{vc},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib},
			Parameters:    map[string]string{ParamStoragePool: "slow"},
		}
	}
	fsResp, err := d1.CreateVolume(ctx, createReq("pvc-fs", mountCap(rw)))
	if err != nil {
		t.Fatal(err)
	}
	fsID := fsResp.GetVolume().GetVolumeId()
	blkResp, err := d1.CreateVolume(ctx, createReq("pvc-blk", blockCap(rw)))
	if err != nil {
		t.Fatal(err)
	}
	blkID := blkResp.GetVolume().GetVolumeId()
	disk, _, _ := d1.VolumeDisk(fsID)
	if err := os.WriteFile(disk, []byte("survives"), 0o600); err != nil {
		t.Fatal(err)
	}
	dev1, _, _ := d1.VolumeDisk(blkID)
	if err := os.WriteFile(dev1, []byte("block bytes"), 0); err != nil {
		t.Fatal(err)
	}
	snap, err := d1.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: fsID})
	if err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(t.TempDir(), "pub")
	if _, err := d1.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: fsID, TargetPath: target, VolumeCapability: mountCap(rw)}); err != nil {
		t.Fatal(err)
	}

	// A process restart: mounts and devices are still there.
	d2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	again, err := d2.CreateVolume(ctx, createReq("pvc-fs", mountCap(rw)))
	if err != nil || again.GetVolume().GetVolumeId() != fsID {
		t.Fatalf("create after restart: %v %v, want the same volume %s", again, err, fsID)
	}
	list, err := d2.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 2 {
		t.Fatalf("volumes after restart: %v %v", list, err)
	}
	if dev2, _, _ := d2.VolumeDisk(blkID); dev2 != dev1 {
		t.Errorf("block device after restart %s, want the same %s", dev2, dev1)
	}
	if _, err := d2.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: fsID, VolumePath: target}); err != nil {
		t.Errorf("publication lost over a restart: %v", err)
	}

	// A reboot: every mount and loop device is gone.
	p := d2.pools["slow"]
	for _, m := range []string{target, p.mountDir(fsID)} {
		if err := unix.Unmount(m, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := detachLoop(dev1); err != nil {
		t.Fatal(err)
	}
	orphan := p.image("0123456789abcdef")
	if err := os.WriteFile(orphan, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	d3, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cleanupDriver(t, d3)
	if _, err := os.Stat(orphan); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("leftover image %s not removed: %v", orphan, err)
	}
	disk3, _, _ := d3.VolumeDisk(fsID)
	if got, err := os.ReadFile(disk3); err != nil || string(got) != "survives" {
		t.Errorf("filesystem volume after reboot holds %q (%v)", got, err)
	}
	dev3, isBlock, err := d3.VolumeDisk(blkID)
	if err != nil || !isBlock {
		t.Fatalf("block volume after reboot: %v", err)
	}
	buf := make([]byte, len("block bytes"))
	if f, err := os.Open(dev3); err != nil {
		t.Fatal(err)
	} else {
		f.Read(buf)
		f.Close()
	}
	if string(buf) != "block bytes" {
		t.Errorf("block volume after reboot holds %q", buf)
	}
	_, err = d3.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: fsID, VolumePath: target})
	wantCode(t, err, codes.NotFound)
	snaps, err := d3.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()})
	if err != nil || len(snaps.GetEntries()) != 1 {
		t.Errorf("snapshot after reboot: %v %v", snaps, err)
	}
}

// TestDeactivate: after Deactivate no mount or loop device of the driver's
// volumes remains, and a new driver brings the data back.
func TestDeactivate(t *testing.T) {
	requireRoot(t)
	cfg := testConfig(t)
	ctx := context.Background()
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "a", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)}, CapacityRange: &csi.CapacityRange{RequiredBytes: 8 * mib}})
	if err != nil {
		t.Fatal(err)
	}
	blk, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "b", VolumeCapabilities: []*csi.VolumeCapability{blockCap(rw)}, CapacityRange: &csi.CapacityRange{RequiredBytes: 8 * mib}})
	if err != nil {
		t.Fatal(err)
	}
	fsID, blkID := fs.GetVolume().GetVolumeId(), blk.GetVolume().GetVolumeId()
	disk, _, _ := d.VolumeDisk(fsID)
	if err := os.WriteFile(disk, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(t.TempDir(), "t")
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: blkID, TargetPath: target, VolumeCapability: blockCap(rw), Readonly: true}); err != nil {
		t.Fatal(err)
	}
	if err := d.Deactivate(); err != nil {
		t.Fatal(err)
	}
	p := d.pools["fast"] // the first pool is the default
	loops, err := loopsByBacking()
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{fsID, blkID} {
		if l := loops[p.image(id)]; len(l) > 0 {
			t.Errorf("volume %s still has loop devices %v", id, l)
		}
	}
	for _, m := range []string{target, p.mountDir(fsID)} {
		if mounted, _ := isMountpoint(m); mounted {
			t.Errorf("%s still mounted", m)
		}
	}
	d2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cleanupDriver(t, d2)
	disk2, _, _ := d2.VolumeDisk(fsID)
	if got, err := os.ReadFile(disk2); err != nil || string(got) != "kept" {
		t.Errorf("after Deactivate and New the volume holds %q (%v)", got, err)
	}
}
