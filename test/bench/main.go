// Command bench runs every nodevirt benchmark program under test/bench/*
// (each measures nodevirt and its anchor in the same run and prints
// report.Result lines), prints one table and writes the results as JSON.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nodevirt/nodevirt/test/bench/report"
)

type run struct {
	Date    string            `json:"date"`
	Machine string            `json:"machine"`
	Results []report.Result   `json:"results"`
	Failed  map[string]string `json:"failed,omitempty"`
}

func main() {
	out := flag.String("out", ".lab/bench.json", "where to write the results")
	only := flag.String("only", "", "comma-separated benchmark names to run (default: all)")
	flag.Parse()

	dirs, err := filepath.Glob("test/bench/*/main.go")
	if err != nil || len(dirs) == 0 {
		fmt.Fprintln(os.Stderr, "bench: run from the repository root; no test/bench/*/main.go found")
		os.Exit(2)
	}
	sort.Strings(dirs)
	r := run{Date: time.Now().UTC().Format(time.RFC3339), Machine: machine(), Failed: map[string]string{}}
	for _, m := range dirs {
		name := filepath.Base(filepath.Dir(m))
		if *only != "" && !contains(strings.Split(*only, ","), name) {
			continue
		}
		fmt.Fprintf(os.Stderr, "==> bench %s\n", name)
		cmd := exec.Command("go", "run", "./"+filepath.Dir(m))
		var stdout bytes.Buffer
		cmd.Stdout = &stdout
		cmd.Stderr = os.Stderr
		err := cmd.Run()
		sc := bufio.NewScanner(&stdout)
		for sc.Scan() {
			var res report.Result
			if json.Unmarshal(sc.Bytes(), &res) == nil && res.Name != "" {
				r.Results = append(r.Results, res)
			}
		}
		if err != nil {
			r.Failed[name] = err.Error()
		}
	}
	print(r)
	if err := os.MkdirAll(filepath.Dir(*out), 0o755); err == nil {
		data, _ := json.MarshalIndent(r, "", "  ")
		if err := os.WriteFile(*out, data, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
		}
	}
	if len(r.Failed) > 0 {
		os.Exit(1)
	}
}

func print(r run) {
	fmt.Printf("\nnodevirt benchmarks, %s, %s\n\n", r.Date, r.Machine)
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "benchmark\tnodevirt\tanchor\tratio\ttarget\tmet")
	for _, res := range r.Results {
		anchor, ratio := "-", "-"
		if res.Anchor != 0 {
			anchor = fmt.Sprintf("%.4g %s (%s)", res.Anchor, res.Unit, res.AnchorName)
			ratio = fmt.Sprintf("%.2fx", res.Ratio())
		} else if res.AnchorName != "" {
			anchor = res.AnchorName
		}
		met := "no"
		if res.Met {
			met = "yes"
		}
		fmt.Fprintf(w, "%s\t%.4g %s\t%s\t%s\t%s\t%s\n", res.Name, res.Value, res.Unit, anchor, ratio, res.Target, met)
	}
	w.Flush()
	for name, err := range r.Failed {
		fmt.Printf("FAILED %s: %s\n", name, err)
	}
}

func machine() string {
	cpu := "unknown cpu"
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(data), "\n") {
			if strings.HasPrefix(l, "model name") {
				cpu = strings.TrimSpace(strings.SplitN(l, ":", 2)[1])
				break
			}
		}
	}
	return fmt.Sprintf("%d cores, %s, %s/%s", runtime.NumCPU(), cpu, runtime.GOOS, runtime.GOARCH)
}

func contains(list []string, s string) bool {
	for _, l := range list {
		if l == s {
			return true
		}
	}
	return false
}
