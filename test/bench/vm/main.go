// Command vm benchmarks nodevirt's VM lifecycle against raw libvirt on the
// same machine, in the same run:
//
//   - create→Running of 1 VM and of N VMs at once through the launcher
//     (define + start, Running as told by the domain's lifecycle event) vs
//     `virsh create` of the same domain XML (target: ≤ 1.2×);
//   - the memory nodevirt's management adds per running VM beyond QEMU: the
//     launcher process's RSS growth, and that plus libvirtd's and virtlogd's,
//     divided by the number of VMs (target: ≤ 8 MiB; KubeVirt: ~240 MiB).
//
// The guests are the test suite's boot disk (64 MiB RAM, 1 vCPU, TCG),
// shared read-only; each is destroyed as soon as the measurement is taken.
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
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/test/bench/report"
	"github.com/nodevirt/nodevirt/test/guest"
)

type config struct {
	uri         string
	vms         int
	rounds      int
	manyRounds  int
	connections int
}

func main() {
	var cfg config
	flag.StringVar(&cfg.uri, "uri", launcher.DefaultURI, "libvirt URI")
	flag.IntVar(&cfg.vms, "vms", 20, "VMs created at once in the parallel measurement")
	flag.IntVar(&cfg.rounds, "rounds", 5, "rounds of the single-VM measurement")
	flag.IntVar(&cfg.connections, "connections", 0, "libvirt connections of the launcher (0: its default)")
	flag.IntVar(&cfg.manyRounds, "many-rounds", 4, "rounds of the N-VM measurement (TCG guests booting at once make single rounds noisy)")
	flag.Parse()
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel()})))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "bench vm:", err)
		os.Exit(1)
	}
}

func logLevel() slog.Level {
	if os.Getenv("NODEVIRT_BENCH_DEBUG") != "" {
		return slog.LevelDebug
	}
	return slog.LevelWarn
}

func run(ctx context.Context, cfg config) error {
	if cfg.vms < 1 || cfg.rounds < 1 || cfg.manyRounds < 1 {
		return errors.New("-vms, -rounds and -many-rounds must be at least 1")
	}
	if cfg.uri == launcher.DefaultURI {
		if err := libvirttest.Start(); err != nil {
			return err
		}
	}
	disk, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "nodevirt-bench-vm-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil {
		return err
	}

	m, err := launcher.Open(launcher.Config{URI: cfg.uri, Connections: cfg.connections})
	if err != nil {
		return err
	}
	defer m.Close()
	b := &bench{cfg: cfg, m: m, disk: disk, dir: dir, running: map[string]chan struct{}{}}
	go b.consumeEvents()
	b.cleanup(ctx)
	defer b.cleanup(context.Background())

	// Warm up both paths once (libvirt caches, page cache of the disk).
	if _, err := b.launcherCreate(ctx, 1, "warm-l"); err != nil {
		return err
	}
	if _, err := b.virshCreate(ctx, 1, "warm-v"); err != nil {
		return err
	}
	b.cleanup(ctx)

	var single, singleVirsh []time.Duration
	for r := range cfg.rounds {
		// Alternate which side goes first, so neither always runs on a
		// machine the other just warmed or loaded.
		sides := []func() error{
			func() error { d, err := b.launcherCreate(ctx, 1, "l1"); single = append(single, d); return err },
			func() error { d, err := b.virshCreate(ctx, 1, "v1"); singleVirsh = append(singleVirsh, d); return err },
		}
		if r%2 == 1 {
			sides[0], sides[1] = sides[1], sides[0]
		}
		for _, side := range sides {
			if err := side(); err != nil {
				return err
			}
			b.cleanup(ctx)
			time.Sleep(settle)
		}
	}
	emitRatio("vm create→running, 1 VM (p50)", report.Percentile(single, 50), report.Percentile(singleVirsh, 50))

	// N at once, for -many-rounds rounds; the sides alternate, ending with
	// the launcher, whose last VMs stay up for the memory measurement.
	var many, manyVirsh []time.Duration
	var rss0 rssSample
	for r := range cfg.manyRounds {
		launcherFirst := (cfg.manyRounds-1-r)%2 == 1
		for i := range 2 {
			if (i == 0) == launcherFirst {
				if rss0, err = b.rss(); err != nil {
					return err
				}
				d, err := b.launcherCreate(ctx, cfg.vms, fmt.Sprintf("ln%d", r))
				if err != nil {
					return err
				}
				many = append(many, d)
			} else {
				d, err := b.virshCreate(ctx, cfg.vms, fmt.Sprintf("vn%d", r))
				if err != nil {
					return err
				}
				manyVirsh = append(manyVirsh, d)
			}
			if r < cfg.manyRounds-1 || i == 0 {
				b.cleanup(ctx)
				time.Sleep(settle) // let the destroyed QEMUs exit
			}
		}
	}
	rssN, err := b.rss()
	if err != nil {
		return err
	}
	emitRatio(fmt.Sprintf("vm create→running, %d VMs at once (all running, p50 of %d)", cfg.vms, cfg.manyRounds),
		report.Percentile(many, 50), report.Percentile(manyVirsh, 50))

	const mib = 1 << 20
	perVM := func(a, b int64) float64 { return float64(b-a) / mib / float64(cfg.vms) }
	launcherPerVM := perVM(rss0.launcher, rssN.launcher)
	totalPerVM := perVM(rss0.total(), rssN.total())
	report.Emit(report.Result{
		Name: fmt.Sprintf("launcher process RSS added per running VM (%d VMs)", cfg.vms), Unit: "MiB",
		Value: launcherPerVM, Target: "<= 8 MiB", LowerIsBetter: true, Met: launcherPerVM <= 8,
	})
	report.Emit(report.Result{
		Name: fmt.Sprintf("launcher+libvirtd+virtlogd RSS added per running VM (%d VMs)", cfg.vms), Unit: "MiB",
		Value: totalPerVM, AnchorName: "KubeVirt ~240 MiB per VM (fixed figure)", Target: "<= 8 MiB",
		LowerIsBetter: true, Met: totalPerVM <= 8,
	})
	l0 := float64(rss0.launcher) / mib
	report.Emit(report.Result{
		Name: "launcher process RSS, 0 VMs", Unit: "MiB", Value: l0,
		Target: "<= 40 MiB (whole node daemon)", LowerIsBetter: true, Met: l0 <= 40,
	})
	return nil
}

func emitRatio(name string, nodevirt, virsh time.Duration) {
	r := report.Result{
		Name: name, Unit: "ms", Value: report.Millis(nodevirt),
		AnchorName: "virsh create, same domain XML", Anchor: report.Millis(virsh),
		Target: "<= 1.2x", LowerIsBetter: true,
	}
	r.Met = r.Ratio() <= 1.2
	report.Emit(r)
}

// settle is the pause after destroying VMs, before the next measurement.
const settle = 2 * time.Second

type bench struct {
	cfg  config
	m    *launcher.Manager
	disk string
	dir  string

	mu      sync.Mutex
	running map[string]chan struct{} // domain -> closed when Started arrives
}

func (b *bench) consumeEvents() {
	for e := range b.m.Events() {
		if e.Type != launcher.EventStarted {
			continue
		}
		b.mu.Lock()
		if ch, ok := b.running[e.Domain]; ok {
			close(ch)
			delete(b.running, e.Domain)
		}
		b.mu.Unlock()
	}
}

// vmi is the benchmark guest: 64 MiB, one vCPU, the shared boot disk
// read-only, serial console, no NIC.
func (b *bench) domain(name string) (*libvirtxml.Domain, error) {
	no := false
	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name, UID: types.UID(uuidFor(name))},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}},
				Devices: v1.Devices{
					AutoattachGraphicsDevice: &no,
					Disks:                    []v1.Disk{{Name: "boot", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{ReadOnly: true}}}},
				},
			},
			Volumes: []v1.Volume{{Name: "boot", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "boot", ReadOnly: true}}}}},
		},
	}
	env := domain.Env{
		Emulation: true,
		StateDir:  filepath.Join(b.dir, name),
		Disks:     map[string]domain.DiskSource{"boot": {Path: b.disk}},
	}
	return domain.Convert(vmi, env)
}

func uuidFor(name string) string {
	h := uint64(1469598103934665603)
	for _, c := range name {
		h = (h ^ uint64(c)) * 1099511628211
	}
	return fmt.Sprintf("b0000000-0000-4000-8000-%012x", h&0xffffffffffff)
}

// launcherCreate creates n VMs at once through the launcher and returns the
// time until the last one is Running (its Started event arrived).
func (b *bench) launcherCreate(ctx context.Context, n int, prefix string) (time.Duration, error) {
	doms := make([]*libvirtxml.Domain, n)
	waits := make([]chan struct{}, n)
	for i := range doms {
		d, err := b.domain(fmt.Sprintf("%s-%d", prefix, i))
		if err != nil {
			return 0, err
		}
		doms[i] = d
		waits[i] = make(chan struct{})
		b.mu.Lock()
		b.running[d.Name] = waits[i]
		b.mu.Unlock()
	}
	start := time.Now()
	errs := make(chan error, n)
	for _, d := range doms {
		go func() {
			t0 := time.Now()
			err := b.m.Create(ctx, d, launcher.StartOptions{})
			slog.Debug("create", "domain", d.Name, "took", time.Since(t0), "since start", time.Since(start))
			errs <- err
		}()
	}
	for range doms {
		if err := <-errs; err != nil {
			return 0, err
		}
	}
	for i, w := range waits {
		select {
		case <-w:
		case <-time.After(2 * time.Minute):
			return 0, fmt.Errorf("no started event for %s", doms[i].Name)
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return time.Since(start), nil
}

// virshCreate writes the same domain XML and runs n `virsh create` at once;
// virsh returns when the domain runs.
func (b *bench) virshCreate(ctx context.Context, n int, prefix string) (time.Duration, error) {
	files := make([]string, n)
	for i := range files {
		d, err := b.domain(fmt.Sprintf("%s-%d", prefix, i))
		if err != nil {
			return 0, err
		}
		doc, err := d.Marshal()
		if err != nil {
			return 0, err
		}
		files[i] = filepath.Join(b.dir, d.Name+".xml")
		if err := os.WriteFile(files[i], []byte(doc), 0o644); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	errs := make(chan error, n)
	for _, f := range files {
		go func() {
			out, err := exec.CommandContext(ctx, "virsh", "-q", "-c", b.cfg.uri, "create", f).CombinedOutput()
			if err != nil {
				err = fmt.Errorf("virsh create %s: %w: %s", f, err, out)
			}
			errs <- err
		}()
	}
	var first error
	for range files {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return time.Since(start), first
}

// cleanup destroys and undefines every benchmark domain.
func (b *bench) cleanup(ctx context.Context) {
	list, err := b.m.List(ctx)
	if err != nil {
		slog.Warn("list for cleanup", "err", err)
	}
	var wg sync.WaitGroup
	for _, d := range list {
		if !strings.HasPrefix(d.Name, "bench_") {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := b.m.Undefine(ctx, d.Name); err != nil {
				slog.Warn("cleanup", "domain", d.Name, "err", err)
			}
		}()
	}
	wg.Wait()
}

type rssSample struct{ launcher, libvirtd, virtlogd int64 }

func (s rssSample) total() int64 { return s.launcher + s.libvirtd + s.virtlogd }

// rss reads the resident memory of this process (after a GC, so that garbage
// does not count) and of libvirtd and virtlogd.
func (b *bench) rss() (rssSample, error) {
	runtime.GC()
	debug.FreeOSMemory()
	time.Sleep(200 * time.Millisecond)
	var s rssSample
	var err error
	if s.launcher, err = rssOf(os.Getpid()); err != nil {
		return s, err
	}
	for _, p := range []struct {
		name string
		dst  *int64
	}{{"libvirtd", &s.libvirtd}, {"virtlogd", &s.virtlogd}} {
		pids, err := pidsNamed(p.name)
		if err != nil {
			return s, err
		}
		for _, pid := range pids {
			v, err := rssOf(pid)
			if err == nil {
				*p.dst += v
			}
		}
	}
	return s, nil
}

func rssOf(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS for pid %d", pid)
}

func pidsNamed(name string) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if err == nil && strings.TrimSpace(string(comm)) == name {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	return pids, nil
}
