// Command csi benchmarks nodevirt's hostpath CSI driver over its unix
// socket, the way a CO calls it:
//
//   - CreateVolume+DeleteVolume latency (p50, p99) for filesystem and block
//     volumes, beside the floor of the same work done with the command-line
//     tools in the same run (truncate, mkfs.ext4, mount, umount, rm), and
//     beside what HPP does per volume (mkdir, rmdir: no size at all);
//   - NodeGetVolumeStats over 1,000 volumes (p50, p99 per call), beside a
//     bare statfs(2) of the same mount points, and the size each volume
//     reports beside the pool size HPP reports for every volume.
//
// There is no HPP binary here, so HPP's behaviour is stated as a target and
// only what can be measured in this run is compared. Everything the
// benchmark creates is removed.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/test/bench/report"
)

type config struct {
	dir        string
	iterations int
	volumes    int
	size       int64
	statsSize  int64
}

const mib = 1 << 20

func main() {
	var cfg config
	flag.StringVar(&cfg.dir, "dir", "/var/tmp", "directory for the pool (a real disk, not tmpfs)")
	flag.IntVar(&cfg.iterations, "iterations", 100, "create+delete rounds per volume kind")
	flag.IntVar(&cfg.volumes, "volumes", 1000, "volumes existing during the NodeGetVolumeStats sweep")
	flag.Int64Var(&cfg.size, "size", 1<<30, "bytes requested per create+delete volume")
	flag.Int64Var(&cfg.statsSize, "stats-size", 16*mib, "bytes requested per volume of the stats sweep")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		slog.Error("csi benchmark", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	if os.Geteuid() != 0 {
		return errors.New("the csi benchmark needs root (loop devices, mounts)")
	}
	work, err := os.MkdirTemp(cfg.dir, "nodevirt-csi-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	sock := filepath.Join(work, "csi.sock")
	d, err := hostpath.New(hostpath.Config{
		NodeID:    "bench-node",
		StateRoot: work,
		Endpoint:  sock,
		Pools:     []hostpath.PoolConfig{{Name: "bench", Path: filepath.Join(work, "pool")}},
		Logger:    slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	})
	if err != nil {
		return err
	}
	srvCtx, stopServer := context.WithCancel(ctx)
	served := make(chan error, 1)
	go func() { served <- d.Run(srvCtx) }()
	defer func() {
		stopServer()
		<-served
	}()
	conn, err := dialWhenUp(ctx, sock)
	if err != nil {
		return err
	}
	defer conn.Close()
	b := &bench{cfg: cfg, work: work, ctrl: csispec.NewControllerClient(conn), node: csispec.NewNodeClient(conn), driver: d}
	defer b.deleteAll()

	if err := b.createDelete(ctx, false); err != nil {
		return err
	}
	if err := b.createDelete(ctx, true); err != nil {
		return err
	}
	return b.stats(ctx)
}

func dialWhenUp(ctx context.Context, sock string) (*grpc.ClientConn, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			return grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil, fmt.Errorf("driver socket %s did not appear", sock)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type bench struct {
	cfg     config
	work    string
	ctrl    csispec.ControllerClient
	node    csispec.NodeClient
	driver  *hostpath.Driver
	created []string
}

func capability(block bool) *csispec.VolumeCapability {
	c := &csispec.VolumeCapability{AccessMode: &csispec.VolumeCapability_AccessMode{
		Mode: csispec.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
	}}
	if block {
		c.AccessType = &csispec.VolumeCapability_Block{Block: &csispec.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csispec.VolumeCapability_Mount{Mount: &csispec.VolumeCapability_MountVolume{}}
	}
	return c
}

func (b *bench) create(ctx context.Context, name string, size int64, block bool) (*csispec.Volume, error) {
	resp, err := b.ctrl.CreateVolume(ctx, &csispec.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csispec.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csispec.VolumeCapability{capability(block)},
	})
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", name, err)
	}
	b.created = append(b.created, resp.GetVolume().GetVolumeId())
	return resp.GetVolume(), nil
}

func (b *bench) deleteAll() {
	for _, id := range b.created {
		_, _ = b.ctrl.DeleteVolume(context.Background(), &csispec.DeleteVolumeRequest{VolumeId: id})
	}
	b.created = nil
}

// createDelete measures CreateVolume+DeleteVolume, the CLI floor of the
// same work and HPP's mkdir+rmdir; it also checks the size is enforced.
func (b *bench) createDelete(ctx context.Context, block bool) error {
	kind := "filesystem"
	if block {
		kind = "block"
	}
	var ours, cli, hpp []time.Duration
	for i := range b.cfg.iterations {
		start := time.Now()
		vol, err := b.create(ctx, fmt.Sprintf("cd-%s-%d", kind, i), b.cfg.size, block)
		if err != nil {
			return err
		}
		if _, err := b.ctrl.DeleteVolume(ctx, &csispec.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
			return fmt.Errorf("delete: %w", err)
		}
		ours = append(ours, time.Since(start))
		b.created = b.created[:len(b.created)-1]

		d, err := b.cliRound(ctx, i, block)
		if err != nil {
			return err
		}
		cli = append(cli, d)

		dir := filepath.Join(b.work, fmt.Sprintf("hpp-%d", i))
		start = time.Now()
		if err := os.Mkdir(dir, 0o750); err != nil {
			return err
		}
		if err := os.Remove(dir); err != nil {
			return err
		}
		hpp = append(hpp, time.Since(start))
	}
	enforced, err := b.enforced(ctx, block)
	if err != nil {
		return err
	}
	target := fmt.Sprintf("<= 1.5x the CLI floor; requested %d MiB enforced", b.cfg.size/mib)
	for _, p := range []float64{50, 99} {
		v, floor := report.Percentile(ours, p), report.Percentile(cli, p)
		report.Emit(report.Result{
			Name:          fmt.Sprintf("csi create+delete %s volume p%.0f", kind, p),
			Unit:          "ms",
			Value:         report.Millis(v),
			AnchorName:    cliAnchorName(block),
			Anchor:        report.Millis(floor),
			Target:        target,
			LowerIsBetter: true,
			Met:           enforced && float64(v) <= 1.5*float64(floor),
		})
	}
	report.Emit(report.Result{
		Name:          fmt.Sprintf("csi create+delete %s volume p50 vs HPP directory", kind),
		Unit:          "ms",
		Value:         report.Millis(report.Percentile(ours, 50)),
		AnchorName:    "HPP-style mkdir+rmdir (no size reported or enforced)",
		Anchor:        report.Millis(report.Percentile(hpp, 50)),
		Target:        "reports and enforces the requested size (HPP does neither)",
		LowerIsBetter: true,
		Met:           enforced,
	})
	return nil
}

func cliAnchorName(block bool) string {
	if block {
		return "truncate+losetup+losetup -d+rm (CLI)"
	}
	return "truncate+mkfs.ext4+mount+umount+rm (CLI)"
}

// cliRound does by hand what a volume create+delete does.
func (b *bench) cliRound(ctx context.Context, i int, block bool) (time.Duration, error) {
	img := filepath.Join(b.work, fmt.Sprintf("cli-%d.img", i))
	dir := filepath.Join(b.work, fmt.Sprintf("cli-%d", i))
	run := func(name string, args ...string) error {
		out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s %v: %w: %s", name, args, err, out)
		}
		return nil
	}
	start := time.Now()
	if err := run("truncate", "-s", fmt.Sprint(b.cfg.size), img); err != nil {
		return 0, err
	}
	if block {
		out, err := exec.CommandContext(ctx, "losetup", "--find", "--show", img).Output()
		if err != nil {
			return 0, fmt.Errorf("losetup: %w", err)
		}
		if err := run("losetup", "-d", string(trimNL(out))); err != nil {
			return 0, err
		}
	} else {
		if err := run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", img); err != nil {
			return 0, err
		}
		if err := os.Mkdir(dir, 0o750); err != nil {
			return 0, err
		}
		if err := run("mount", "-o", "loop", img, dir); err != nil {
			return 0, err
		}
		if err := run("umount", dir); err != nil {
			return 0, err
		}
		if err := os.Remove(dir); err != nil {
			return 0, err
		}
	}
	if err := os.Remove(img); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

func trimNL(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == ' ') {
		b = b[:len(b)-1]
	}
	return b
}

// enforced checks that a small volume of this kind refuses data past its
// size.
func (b *bench) enforced(ctx context.Context, block bool) (bool, error) {
	vol, err := b.create(ctx, fmt.Sprintf("enforce-%v", block), 8*mib, block)
	if err != nil {
		return false, err
	}
	path, _, err := b.driver.VolumeDisk(vol.GetVolumeId())
	if err != nil {
		return false, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return false, err
	}
	defer f.Close()
	buf := make([]byte, mib)
	for i := range buf {
		buf[i] = 0x5a
	}
	for off := int64(0); off < 16*mib; off += mib {
		if _, err := f.WriteAt(buf, off); err != nil {
			return errors.Is(err, syscall.ENOSPC) || block, nil
		}
	}
	if err := f.Sync(); err != nil {
		return errors.Is(err, syscall.ENOSPC), nil
	}
	return false, nil
}

// stats creates the sweep's volumes and measures NodeGetVolumeStats on each.
func (b *bench) stats(ctx context.Context) error {
	var paths []string
	var ids []string
	createStart := time.Now()
	for i := range b.cfg.volumes {
		vol, err := b.create(ctx, fmt.Sprintf("stats-%d", i), b.cfg.statsSize, false)
		if err != nil {
			return err
		}
		path, err := b.driver.VolumePath(vol.GetVolumeId())
		if err != nil {
			return err
		}
		ids = append(ids, vol.GetVolumeId())
		paths = append(paths, path)
	}
	createTime := time.Since(createStart)

	var ours, floor []time.Duration
	var reported int64
	sweepStart := time.Now()
	for i, id := range ids {
		start := time.Now()
		resp, err := b.node.NodeGetVolumeStats(ctx, &csispec.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: paths[i]})
		if err != nil {
			return fmt.Errorf("stats %s: %w", id, err)
		}
		ours = append(ours, time.Since(start))
		if i == 0 {
			reported = resp.GetUsage()[0].GetTotal()
		}
	}
	sweep := time.Since(sweepStart)
	for _, p := range paths {
		var st unix.Statfs_t
		start := time.Now()
		if err := unix.Statfs(p, &st); err != nil {
			return err
		}
		floor = append(floor, time.Since(start))
	}
	var pool unix.Statfs_t
	if err := unix.Statfs(filepath.Join(b.work, "pool"), &pool); err != nil {
		return err
	}

	n := len(ids)
	for _, p := range []float64{50, 99} {
		v, f := report.Percentile(ours, p), report.Percentile(floor, p)
		report.Emit(report.Result{
			Name:          fmt.Sprintf("csi NodeGetVolumeStats p%.0f at %d volumes", p, n),
			Unit:          "ms",
			Value:         report.Millis(v),
			AnchorName:    "statfs(2) of the same mount point",
			Anchor:        report.Millis(f),
			Target:        "<= 1 ms per call",
			LowerIsBetter: true,
			Met:           v <= time.Millisecond,
		})
	}
	report.Emit(report.Result{
		Name:          fmt.Sprintf("csi NodeGetVolumeStats sweep of %d volumes", n),
		Unit:          "ms",
		Value:         report.Millis(sweep),
		Target:        "< 1 s for 1,000 volumes",
		LowerIsBetter: true,
		Met:           sweep < time.Second,
	})
	report.Emit(report.Result{
		Name:          fmt.Sprintf("csi create of %d volumes (%d MiB each), mean", n, b.cfg.statsSize/mib),
		Unit:          "ms",
		Value:         report.Millis(createTime) / float64(n),
		Target:        "informational",
		LowerIsBetter: true,
		Met:           true,
	})
	// What one volume reports: ours is its own filesystem (the requested
	// size less ext4's overhead); HPP reports the whole pool.
	poolBytes := int64(pool.Blocks) * pool.Bsize
	report.Emit(report.Result{
		Name:          fmt.Sprintf("csi reported size of a %d MiB volume", b.cfg.statsSize/mib),
		Unit:          "MiB",
		Value:         float64(reported) / mib,
		AnchorName:    "pool size (what HPP reports for every volume)",
		Anchor:        float64(poolBytes) / mib,
		Target:        "reports requested size (within ext4 overhead)",
		LowerIsBetter: false,
		Met:           reported <= b.cfg.statsSize && reported >= b.cfg.statsSize*8/10,
	})
	return nil
}
