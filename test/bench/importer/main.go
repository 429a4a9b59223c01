// Command importer benchmarks nodevirt's HTTP disk import against what CDI
// users compare it with: `curl -o` of the image followed by `qemu-img
// convert` to raw, on the same image, the same loopback server and the same
// kind of destination (a raw file), in the same run. Both sides end with
// the destination fsynced (qemu-img convert does not flush by default, so
// the anchor runs `sync` on its output, which the importer does itself).
//
// It prints one report.Result per image format (MiB/s of virtual size) and
// removes everything it created.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/nodevirt/nodevirt/nodeagent/importer"
	"github.com/nodevirt/nodevirt/test/bench/report"
)

type config struct {
	dir     string
	size    int64
	dataMiB int
	rounds  int
}

func main() {
	var cfg config
	flag.StringVar(&cfg.dir, "dir", "/var/tmp", "directory for the images and destinations (a real disk, not tmpfs)")
	flag.Int64Var(&cfg.size, "size", 1<<30, "virtual size of the images in bytes")
	flag.IntVar(&cfg.dataMiB, "data", 320, "MiB of real (non-zero) data in the images")
	flag.IntVar(&cfg.rounds, "rounds", 3, "measurements per side; the median is reported")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		slog.Error("importer benchmark", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	for _, tool := range []string{"curl", "qemu-img", "sync"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is needed: %w", tool, err)
		}
	}
	work, err := os.MkdirTemp(cfg.dir, "nodevirt-import-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	src := filepath.Join(work, "src")
	dst := filepath.Join(work, "dst")
	for _, d := range []string{src, dst} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	raw := filepath.Join(src, "disk.raw")
	if err := makeImage(raw, cfg.size, cfg.dataMiB); err != nil {
		return fmt.Errorf("make image: %w", err)
	}
	if out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, filepath.Join(src, "disk.qcow2")).CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img convert: %v: %s", err, out)
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: http.FileServer(http.Dir(src)), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	go srv.Serve(ln)
	defer srv.Close()
	base := "http://" + ln.Addr().String() + "/"

	for _, img := range []struct{ file, format string }{{"disk.raw", "raw"}, {"disk.qcow2", "qcow2"}} {
		var ours, anchor []time.Duration
		for range cfg.rounds {
			d, err := timeImporter(ctx, base+img.file, filepath.Join(dst, "disk.img"), cfg.size)
			if err != nil {
				return fmt.Errorf("importer %s: %w", img.file, err)
			}
			ours = append(ours, d)
			if d, err = timeCurlConvert(ctx, base+img.file, img.format, dst); err != nil {
				return fmt.Errorf("curl + qemu-img %s: %w", img.file, err)
			}
			anchor = append(anchor, d)
		}
		mib := float64(cfg.size) / (1 << 20)
		r := report.Result{
			Name:       fmt.Sprintf("http import %s, %d MiB virtual, %d MiB data (MiB/s of virtual size)", img.format, cfg.size>>20, cfg.dataMiB),
			Unit:       "MiB/s",
			Value:      round2(mib / median(ours).Seconds()),
			AnchorName: "curl -o then qemu-img convert -O raw (+sync)",
			Anchor:     round2(mib / median(anchor).Seconds()),
			Target:     ">= 1.0x",
		}
		r.Met = r.Ratio() >= 1.0
		report.Emit(r)
		fmt.Fprintf(os.Stderr, "%s: nodevirt %.0f MiB/s (%v), anchor %.0f MiB/s (%v), ratio %.2fx\n",
			img.format, r.Value, ours, r.Anchor, anchor, r.Ratio())
	}
	return nil
}

// makeImage writes a sparse raw disk of size bytes holding dataMiB MiB of
// data in 4 MiB extents spread over the disk: alternately random
// (incompressible) and text-like (compressible), as in a real root disk.
func makeImage(path string, size int64, dataMiB int) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return err
	}
	const extent = 4 << 20
	n := dataMiB / 4
	rnd := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, extent)
	stride := (size / int64(n)) &^ (extent - 1)
	for i := range n {
		for j := 0; j < len(buf); j += 8 {
			v := rnd.Uint64()
			for k := range 8 {
				buf[j+k] = byte(v >> (8 * k))
			}
		}
		if i%2 == 1 {
			for j := range buf {
				buf[j] = "etc/usr/lib/bin "[buf[j]&15]
			}
		}
		if _, err := f.WriteAt(buf, int64(i)*stride); err != nil {
			return err
		}
	}
	return f.Sync()
}

func timeImporter(ctx context.Context, url, dest string, capacity int64) (time.Duration, error) {
	defer os.Remove(dest)
	start := time.Now()
	_, err := importer.Import(ctx, importer.Request{
		// The image server listens on loopback, which imports may reach
		// only when allowed.
		Source:   importer.Source{HTTP: &importer.HTTPSource{URL: url, AllowedNetworks: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}},
		Dest:     dest,
		Capacity: capacity,
	})
	return time.Since(start), err
}

func timeCurlConvert(ctx context.Context, url, format, dir string) (time.Duration, error) {
	dl, dest := filepath.Join(dir, "download.img"), filepath.Join(dir, "anchor.img")
	defer os.Remove(dl)
	defer os.Remove(dest)
	start := time.Now()
	for _, args := range [][]string{
		{"curl", "-sSf", "-o", dl, url},
		{"qemu-img", "convert", "-f", format, "-O", "raw", dl, dest},
		{"sync", dest},
	} {
		if out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput(); err != nil {
			return 0, fmt.Errorf("%v: %v: %s", args, err, out)
		}
	}
	return time.Since(start), nil
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func round2(v float64) float64 { return float64(int64(v*100+0.5)) / 100 }
