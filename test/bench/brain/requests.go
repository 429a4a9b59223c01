package main

import (
	"fmt"
	"os"

	"github.com/nodevirt/nodevirt/test/bench/measure"
)

// printRequestDelta writes the requests made between before and after,
// per object created, to stderr (watches left out).
func printRequestDelta(before, after measure.Requests, perObjects int) {
	rows, writes := measure.Delta(before, after)
	fmt.Fprintf(os.Stderr, "api writes during the burst: %.0f (%.2f per vm)\n", writes, writes/float64(perObjects))
	for _, r := range rows {
		fmt.Fprintf(os.Stderr, "  %-60s %6.0f  %.2f/vm\n", r.Key, r.N, r.N/float64(perObjects))
	}
}

// apiserverPid finds the kube-apiserver whose command line mentions dir
// (the control plane started for this run), or 0.
func apiserverPid(dir string) int { return measure.ControlPlanePid("kube-apiserver", dir) }
