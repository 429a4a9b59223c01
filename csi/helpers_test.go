package csi

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/nodevirt/nodevirt/test/testkit"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("these tests need root: they loop-mount volume images")
	}
}

// testConfig is a driver with two pools in a temporary state root.
func testConfig(t *testing.T) Config {
	root := t.TempDir()
	return Config{
		NodeID:            "node-a",
		StateRoot:         root,
		Endpoint:          filepath.Join(root, "csi.sock"),
		MaxVolumesPerNode: 64,
		Pools: []PoolConfig{
			{Name: "fast", Path: filepath.Join(root, "pools", "fast")},
			{Name: "slow", Path: filepath.Join(root, "pools", "slow")},
		},
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
}

// testWriter sends log lines to the test log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(string(b))
	return len(b), nil
}

// startDriver serves a driver for cfg until the test ends and removes
// every volume it still holds, so no mount or loop device outlives a test.
func startDriver(t *testing.T, cfg Config) (*Driver, string) {
	t.Helper()
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	sock := cfg.Endpoint
	testkit.Eventually(t, 5*time.Second, "the driver socket", func() error {
		_, err := os.Stat(sock)
		return err
	})
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
		cleanupDriver(t, d)
	})
	return d, sock
}

// cleanupDriver unpublishes and deletes every volume and snapshot of d.
func cleanupDriver(t *testing.T, d *Driver) {
	ctx := context.Background()
	d.mu.Lock()
	var vols []volume
	for _, v := range d.volumes {
		vols = append(vols, v.clone())
	}
	var snaps []string
	for id := range d.snapshots {
		snaps = append(snaps, id)
	}
	d.mu.Unlock()
	for _, v := range vols {
		for target := range v.Published {
			if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.ID, TargetPath: target}); err != nil {
				t.Errorf("cleanup unpublish %s: %v", v.ID, err)
			}
		}
		if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.ID}); err != nil {
			t.Errorf("cleanup delete %s: %v", v.ID, err)
		}
	}
	for _, id := range snaps {
		if _, err := d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
			t.Errorf("cleanup delete snapshot %s: %v", id, err)
		}
	}
}

// dial connects a gRPC client to the driver socket.
func dial(t *testing.T, sock string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}
