// Command cni benchmarks CNI ADD+DEL latency of nodevirt's cnv-bridge
// against Debian's reference bridge plugin, same config (a bridge with
// host-local IPAM), same run, in throwaway network namespaces. It prints
// p50/p99 for sequential cycles and for 20 concurrent containers as
// report.Result lines.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/nodevirt/nodevirt/cni/cnitest"
	"github.com/nodevirt/nodevirt/test/bench/report"
)

func main() {
	seq := flag.Int("cycles", 200, "sequential ADD+DEL cycles per plugin")
	conc := flag.Int("concurrency", 20, "concurrent containers")
	rounds := flag.Int("rounds", 5, "concurrent rounds per plugin")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *seq, *conc, *rounds); err != nil {
		slog.Error("cni bench", "error", err)
		os.Exit(1)
	}
}

// subject is one plugin under test with its own host namespace.
type subject struct {
	name string
	rt   *cnitest.Runtime
	conf []byte
	host *cnitest.NS
}

func newSubject(work, name, pluginType, pluginDir, subnet string) (*subject, error) {
	host, err := cnitest.NewNS("nvbench-" + name)
	if err != nil {
		return nil, err
	}
	conf, err := json.Marshal(map[string]any{
		"cniVersion": "1.0.0", // the reference plugin speaks up to 1.0.0
		"name":       "bench",
		"type":       pluginType,
		"bridge":     "brbench",
		"isGateway":  true,
		"stateDir":   filepath.Join(work, name, "state"), // ignored by the reference
		"ipam": map[string]any{
			"type": "host-local", "subnet": subnet, "dataDir": filepath.Join(work, name, "ipam"),
		},
	})
	if err != nil {
		return nil, err
	}
	rt := cnitest.NewRuntime(host, []string{pluginDir}, filepath.Join(work, name, "cache"))
	return &subject{name: name, rt: rt, conf: conf, host: host}, nil
}

// cycle runs one ADD+DEL and returns its latency.
func (s *subject) cycle(ctx context.Context, id string, ctr *cnitest.NS) (time.Duration, error) {
	att := cnitest.Attachment(id, ctr, "eth0")
	start := time.Now()
	if _, err := s.rt.Add(ctx, s.conf, att); err != nil {
		return 0, fmt.Errorf("%s ADD: %w", s.name, err)
	}
	if err := s.rt.Del(ctx, s.conf, att); err != nil {
		return 0, fmt.Errorf("%s DEL: %w", s.name, err)
	}
	return time.Since(start), nil
}

func run(ctx context.Context, cycles, conc, rounds int) error {
	work, err := os.MkdirTemp("", "nodevirt-cni-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	ours, err := cnitest.BuildPlugin(ctx, filepath.Join(work, "ours-bin"))
	if err != nil {
		return err
	}
	refDir := filepath.Join(work, "ref-bin")
	if err := os.MkdirAll(refDir, 0o755); err != nil {
		return err
	}
	for _, p := range []string{"bridge", "host-local"} {
		if err := os.Symlink(filepath.Join(cnitest.ReferenceDir, p), filepath.Join(refDir, p)); err != nil {
			return err
		}
	}
	us, err := newSubject(work, "ours", "cnv-bridge", ours, "10.98.0.0/16")
	if err != nil {
		return err
	}
	defer us.host.Close()
	ref, err := newSubject(work, "ref", "bridge", refDir, "10.99.0.0/16")
	if err != nil {
		return err
	}
	defer ref.host.Close()
	subjects := []*subject{us, ref}

	ctrs := make([]*cnitest.NS, conc)
	for i := range ctrs {
		if ctrs[i], err = cnitest.NewNS("nvbench-ctr"); err != nil {
			return err
		}
		defer ctrs[i].Close()
	}

	// Warm up (bridge creation, page cache), then interleave the plugins so
	// drift on a shared machine hits both alike.
	for _, s := range subjects {
		if _, err := s.cycle(ctx, "warm", ctrs[0]); err != nil {
			return err
		}
	}
	seqLat := map[string][]time.Duration{}
	for i := range cycles {
		for _, s := range subjects {
			d, err := s.cycle(ctx, fmt.Sprintf("seq%d", i), ctrs[0])
			if err != nil {
				return err
			}
			seqLat[s.name] = append(seqLat[s.name], d)
		}
	}
	concLat := map[string][]time.Duration{}
	for r := range rounds {
		for _, s := range subjects {
			ds, err := concurrentRound(ctx, s, r, ctrs)
			if err != nil {
				return err
			}
			concLat[s.name] = append(concLat[s.name], ds...)
		}
	}
	emit("sequential", seqLat)
	emit(fmt.Sprintf("%d concurrent", conc), concLat)
	return nil
}

func concurrentRound(ctx context.Context, s *subject, round int, ctrs []*cnitest.NS) ([]time.Duration, error) {
	var wg sync.WaitGroup
	ds := make([]time.Duration, len(ctrs))
	errs := make([]error, len(ctrs))
	for i, c := range ctrs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ds[i], errs[i] = s.cycle(ctx, fmt.Sprintf("c%d-%d", round, i), c)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return ds, nil
}

func emit(mode string, lat map[string][]time.Duration) {
	for _, p := range []float64{50, 99} {
		v := report.Millis(report.Percentile(lat["ours"], p))
		a := report.Millis(report.Percentile(lat["ref"], p))
		r := report.Result{
			Name:          fmt.Sprintf("cni add+del p%.0f (%s)", p, mode),
			Unit:          "ms",
			Value:         v,
			AnchorName:    "reference bridge plugin (Debian containernetworking-plugins)",
			Anchor:        a,
			Target:        "<= 0.5x",
			LowerIsBetter: true,
		}
		r.Met = r.Anchor > 0 && r.Ratio() <= 0.5
		report.Emit(r)
	}
}
