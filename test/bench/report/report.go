// Package report is the common output of nodevirt's benchmarks: every benchmark
// program measures nodevirt and its anchor in the same run and prints one
// Result per figure as a JSON line, which `make bench` gathers into a table and
// into .lab/bench.json.
package report

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"time"
)

// Result is one measured figure beside its anchor.
type Result struct {
	// Name says what was measured, e.g. "cni add+del p50 (sequential)".
	Name string `json:"name"`
	// Unit of Value and Anchor, e.g. "ms", "MiB", "MiB/s".
	Unit string `json:"unit"`
	// Value is nodevirt's figure.
	Value float64 `json:"value"`
	// AnchorName names what nodevirt is compared against, e.g. "reference bridge plugin".
	AnchorName string `json:"anchorName,omitempty"`
	// Anchor is the anchor's figure measured in the same run (0 when the
	// anchor is a fixed target rather than a measurement).
	Anchor float64 `json:"anchor,omitempty"`
	// Target states the goal, e.g. "<= 0.5x" or "<= 8 MiB".
	Target string `json:"target,omitempty"`
	// LowerIsBetter tells how Ratio reads.
	LowerIsBetter bool `json:"lowerIsBetter"`
	// Met reports whether the target was reached.
	Met bool `json:"met"`
}

// Ratio is Value/Anchor, or 0 when there is no measured anchor.
func (r Result) Ratio() float64 {
	if r.Anchor == 0 {
		return 0
	}
	return r.Value / r.Anchor
}

// Emit writes r as one JSON line to stdout.
func Emit(r Result) {
	EmitTo(os.Stdout, r)
}

// EmitTo writes r as one JSON line to w.
func EmitTo(w io.Writer, r Result) {
	b, err := json.Marshal(r)
	if err != nil {
		panic(err) // a Result always marshals
	}
	fmt.Fprintf(w, "%s\n", b)
}

// Percentile returns the p-th percentile (0..100) of ds, nearest-rank.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	idx := int(float64(len(s))*p/100+0.5) - 1
	if idx < 0 {
		idx = 0
	}
	if idx >= len(s) {
		idx = len(s) - 1
	}
	return s[idx]
}

// Millis converts d to fractional milliseconds.
func Millis(d time.Duration) float64 {
	return float64(d) / float64(time.Millisecond)
}
