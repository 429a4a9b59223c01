// Command cni benchmarks CNI ADD+DEL latency of nodevirt's cnv-bridge
// against Debian's reference bridge plugin, same config (a bridge with
// host-local IPAM), same run, in throwaway network namespaces. It prints
// p50/p99 for sequential cycles and for 20 concurrent containers, the same
// sequentially with MAC spoof-check rules on (nftables: netlink for
// cnv-bridge, the nft binary for the reference), and what nodevirt's
// plugin left behind after all its cycles, as report.Result lines.
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
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/cni/cnitest"
	"github.com/nodevirt/nodevirt/test/bench/report"
)

func main() {
	seq := flag.Int("cycles", 200, "sequential ADD+DEL cycles per plugin")
	conc := flag.Int("concurrency", 20, "concurrent containers")
	rounds := flag.Int("rounds", 5, "concurrent rounds per plugin")
	spoofCycles := flag.Int("spoof-cycles", 100, "sequential ADD+DEL cycles per plugin with macspoofchk")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *seq, *conc, *rounds, *spoofCycles); err != nil {
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
	dir  string // state and IPAM data
}

func newSubject(work, name, pluginType, pluginDir, subnet string, spoofCheck bool) (*subject, error) {
	host, err := cnitest.NewNS("nvbench-" + name)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(work, name)
	conf, err := json.Marshal(map[string]any{
		"cniVersion":  "1.0.0", // the reference plugin speaks up to 1.0.0
		"name":        "bench",
		"type":        pluginType,
		"bridge":      "brbench",
		"isGateway":   true,
		"macspoofchk": spoofCheck,
		"stateDir":    filepath.Join(dir, "state"), // ignored by the reference
		"ipam": map[string]any{
			"type": "host-local", "subnet": subnet, "dataDir": filepath.Join(dir, "ipam"),
		},
	})
	if err != nil {
		return nil, err
	}
	rt := cnitest.NewRuntime(host, []string{pluginDir}, filepath.Join(dir, "cache"))
	return &subject{name: name, rt: rt, conf: conf, host: host, dir: dir}, nil
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

// leftovers counts what the subject's attachments left after their DELs:
// links in its host namespace beside lo and the bridge, nft chains or map
// entries of attachments, IPAM reservations and state records.
func (s *subject) leftovers(ctx context.Context) (int, string, error) {
	var what []string
	err := s.host.Do(func() error {
		ls, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range ls {
			if n := l.Attrs().Name; n != "lo" && n != "brbench" {
				what = append(what, "link "+n)
			}
		}
		return nil
	})
	if err != nil {
		return 0, "", err
	}
	rs, err := s.host.Run(ctx, "nft", "list", "ruleset")
	if err != nil {
		return 0, "", err
	}
	for _, line := range strings.Split(rs, "\n") {
		if f := strings.Fields(line); (len(f) >= 2 && f[0] == "chain" && strings.HasPrefix(f[1], "spoof_")) || strings.Contains(line, "jump") {
			what = append(what, "nft "+strings.TrimSpace(line))
		}
	}
	_ = filepath.Walk(s.dir, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return nil
		}
		base := filepath.Base(p)
		switch {
		case strings.HasSuffix(p, ".json") && strings.Contains(p, "/state/"):
			what = append(what, "state "+base)
		case strings.Contains(p, "/ipam/") && base != "lock" && !strings.HasPrefix(base, "last_reserved_ip"):
			what = append(what, "ipam "+base)
		case strings.Contains(p, "/cache/"):
			what = append(what, "libcni cache "+base)
		}
		return nil
	})
	return len(what), strings.Join(what, ", "), nil
}

func run(ctx context.Context, cycles, conc, rounds, spoofCycles int) error {
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
	var all []*subject
	mk := func(name, typ, dir, subnet string, spoof bool) (*subject, error) {
		s, err := newSubject(work, name, typ, dir, subnet, spoof)
		if err == nil {
			all = append(all, s)
		}
		return s, err
	}
	defer func() {
		for _, s := range all {
			s.host.Close()
		}
	}()
	us, err := mk("ours", "cnv-bridge", ours, "10.98.0.0/16", false)
	if err != nil {
		return err
	}
	ref, err := mk("ref", "bridge", refDir, "10.99.0.0/16", false)
	if err != nil {
		return err
	}
	usSpoof, err := mk("ours-spoof", "cnv-bridge", ours, "10.96.0.0/16", true)
	if err != nil {
		return err
	}
	refSpoof, err := mk("ref-spoof", "bridge", refDir, "10.97.0.0/16", true)
	if err != nil {
		return err
	}

	ctrs := make([]*cnitest.NS, conc)
	for i := range ctrs {
		if ctrs[i], err = cnitest.NewNS("nvbench-ctr"); err != nil {
			return err
		}
		defer ctrs[i].Close()
	}

	// Warm up (bridge creation, nft tables, page cache), then interleave
	// the plugins so drift on a shared machine hits both alike.
	for _, s := range all {
		if _, err := s.cycle(ctx, "warm", ctrs[0]); err != nil {
			return err
		}
	}
	sequential := func(pair []*subject, n int) (map[string][]time.Duration, error) {
		lat := map[string][]time.Duration{}
		for i := range n {
			for _, s := range pair {
				d, err := s.cycle(ctx, fmt.Sprintf("seq%d", i), ctrs[0])
				if err != nil {
					return nil, err
				}
				lat[s.name] = append(lat[s.name], d)
			}
		}
		return lat, nil
	}
	seqLat, err := sequential([]*subject{us, ref}, cycles)
	if err != nil {
		return err
	}
	concLat := map[string][]time.Duration{}
	for r := range rounds {
		for _, s := range []*subject{us, ref} {
			ds, err := concurrentRound(ctx, s, r, ctrs)
			if err != nil {
				return err
			}
			concLat[s.name] = append(concLat[s.name], ds...)
		}
	}
	spoofLat, err := sequential([]*subject{usSpoof, refSpoof}, spoofCycles)
	if err != nil {
		return err
	}
	emit("sequential", seqLat["ours"], seqLat["ref"], 0.3, 0.5)
	emit(fmt.Sprintf("%d concurrent", conc), concLat["ours"], concLat["ref"], 0.4, 0.4)
	emit("sequential, macspoofchk", spoofLat["ours-spoof"], spoofLat["ref-spoof"], 0.3, 0.5)

	total := 0
	var what []string
	for _, s := range []*subject{us, usSpoof} {
		n, w, err := s.leftovers(ctx)
		if err != nil {
			return err
		}
		total += n
		if w != "" {
			what = append(what, w)
		}
	}
	name := fmt.Sprintf("cni leftovers after %d ADD+DEL cycles (links, nft chains/entries, IPAM, state, cache)",
		1+cycles+rounds*conc+1+spoofCycles)
	if len(what) > 0 {
		name += ": " + strings.Join(what, "; ")
	}
	report.Emit(report.Result{Name: name, Unit: "objects", Value: float64(total), Target: "0", LowerIsBetter: true, Met: total == 0})
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

// emit prints p50 and p99 of ours against the reference, with the target
// ratio of each.
func emit(mode string, ours, ref []time.Duration, p50Target, p99Target float64) {
	for _, p := range []struct {
		pct, target float64
	}{{50, p50Target}, {99, p99Target}} {
		r := report.Result{
			Name:          fmt.Sprintf("cni add+del p%.0f (%s)", p.pct, mode),
			Unit:          "ms",
			Value:         report.Millis(report.Percentile(ours, p.pct)),
			AnchorName:    "reference bridge plugin (Debian containernetworking-plugins)",
			Anchor:        report.Millis(report.Percentile(ref, p.pct)),
			Target:        fmt.Sprintf("<= %.1fx", p.target),
			LowerIsBetter: true,
		}
		r.Met = r.Anchor > 0 && r.Ratio() <= p.target
		report.Emit(r)
	}
}
