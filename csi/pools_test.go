package csi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// TestPoolsAddedAndRemovedWhileServing: a pool added to a running driver
// takes volumes at once, is listed, refuses a clash, cannot be removed
// while it holds a volume, brings its volume back when added to a fresh
// driver (an agent restart), and goes away once empty.
func TestPoolsAddedAndRemovedWhileServing(t *testing.T) {
	requireRoot(t)
	cfg := testConfig(t)
	d, sock := startDriver(t, cfg)
	c := newClients(t, sock)
	ctx := context.Background()
	extra := PoolConfig{Name: "extra", Path: filepath.Join(t.TempDir(), "extra", "csi")}

	_, err := c.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-early", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rw)},
		Parameters: map[string]string{ParamStoragePool: "extra"}})
	wantCode(t, err, codes.InvalidArgument)

	if err := d.AddPool(extra); err != nil {
		t.Fatal(err)
	}
	if err := d.AddPool(extra); err != nil {
		t.Fatalf("adding the same pool again: %v", err)
	}
	if got := d.Pools(); len(got) != 3 || got[0] != "fast" || got[1] != "extra" {
		t.Fatalf("pools %v, want the default first, then by name: fast, extra, slow", got)
	}
	for _, bad := range []PoolConfig{
		{Name: "extra", Path: filepath.Join(t.TempDir(), "elsewhere")},
		{Name: "inside", Path: filepath.Join(extra.Path, "volumes", "x")},
		{Name: "../up", Path: t.TempDir()},
		{Name: "rel", Path: "relative/dir"},
	} {
		if err := d.AddPool(bad); err == nil {
			t.Errorf("AddPool(%+v) succeeded", bad)
		}
	}
	vol := c.create(t, "pvc-extra", "extra", 16*mib, mountCap(rw))
	if _, err := os.Stat(filepath.Join(extra.Path, "volumes", vol.GetVolumeId()+".img")); err != nil {
		t.Fatalf("volume not in the added pool: %v", err)
	}
	disk, _, err := d.VolumeDisk(vol.GetVolumeId())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(disk, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := d.RemovePool("extra"); !errors.Is(err, ErrPoolInUse) {
		t.Fatalf("removing a pool with a volume: %v, want ErrPoolInUse", err)
	}
	if err := d.RemovePool("fast"); !errors.Is(err, ErrPoolInUse) {
		t.Fatalf("removing the default pool: %v, want ErrPoolInUse", err)
	}

	// A restarted agent opens its flag pools, then adds the pool again.
	d2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d2.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: vol.GetVolumeId()}); err == nil {
		t.Fatal("a volume of a pool not yet added is served")
	}
	if err := d2.AddPool(extra); err != nil {
		t.Fatal(err)
	}
	disk2, _, err := d2.VolumeDisk(vol.GetVolumeId())
	if b, rerr := os.ReadFile(disk2); err != nil || rerr != nil || string(b) != "kept" {
		t.Fatalf("volume after re-adding its pool: %q %v %v", b, err, rerr)
	}

	if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	if err := d.RemovePool("extra"); err != nil {
		t.Fatalf("removing the emptied pool: %v", err)
	}
	if err := d.RemovePool("extra"); err != nil {
		t.Fatalf("removing a pool no longer served: %v", err)
	}
	if _, ok := d.PoolPath("extra"); ok {
		t.Fatal("removed pool still served")
	}
}
