package main

import (
	"fmt"
	"os"
	"time"

	"github.com/nodevirt/nodevirt/test/bench/report"
)

// emit prints each point's figures, then, per node count measured at
// several VM counts, how the per-VM cost grew from the smallest count to
// the largest (the smallest is the anchor, from the same run) and the
// least-squares slope of the placement time.
func emit(points []point) {
	for _, p := range points {
		at := fmt.Sprintf("%s VMs on %d nodes", thousands(p.VMs), p.Nodes)
		name := "scale: place " + at + " (first create → all scheduled)"
		target := time.Duration(p.VMs) * placePerVMTarget
		if p.Placed < p.VMs {
			name += fmt.Sprintf(" — only %d placed", p.Placed)
		}
		if p.Refused > 0 {
			name += fmt.Sprintf(" — %d creates refused (tried again)", p.Refused)
		}
		report.Emit(report.Result{Name: name, Unit: "s", Value: p.Place.Seconds(),
			Target: fmt.Sprintf("< %.0f s (6 ms/VM: 10,000 in 60 s)", target.Seconds()), LowerIsBetter: true,
			Met: p.Placed == p.VMs && p.Place < target})
		report.Emit(report.Result{Name: "scale: brain CPU per VM, " + at + " (burst + settle)", Unit: "ms",
			Value: ms(p.CPUPerVM()), Target: "informational", LowerIsBetter: true, Met: true})
		report.Emit(report.Result{Name: "scale: API writes per VM, " + at + " (heartbeats left out)", Unit: "writes",
			Value: p.Writes / float64(p.VMs), AnchorName: "3: VM, VMI, binding (the fewest any brain makes)",
			Target: "informational", LowerIsBetter: true, Met: true})
		report.Emit(report.Result{Name: "scale: brain peak RSS, " + at, Unit: "MiB", Value: p.PeakRSS,
			Target: fmt.Sprintf("< %.0f MiB", rssTarget), LowerIsBetter: true, Met: p.PeakRSS < rssTarget})
		report.Emit(report.Result{Name: "scale: idle brain CPU with " + at, Unit: "% of a core", Value: 100 * p.IdleAfter,
			AnchorName: "idle brain, same nodes, no VM", Anchor: 100 * p.IdleBefore,
			Target: fmt.Sprintf("< %.0f %% of a core", 100*idleTarget), LowerIsBetter: true, Met: p.IdleAfter < idleTarget})
	}
	for _, curve := range byNodes(points) {
		if len(curve) < 2 {
			continue
		}
		lo, hi := curve[0], curve[len(curve)-1]
		span := fmt.Sprintf("%s → %s VMs on %d nodes", thousands(lo.VMs), thousands(hi.VMs), hi.Nodes)
		anchor := fmt.Sprintf("the same at %s VMs, same run", thousands(lo.VMs))
		slope, intercept := fit(curve)
		fmt.Fprintf(os.Stderr, "%d nodes: placement time ≈ %.2f s + %.3f ms × VMs (least squares over %d points)\n",
			hi.Nodes, intercept, slope, len(curve))
		report.Emit(report.Result{Name: fmt.Sprintf("scale: placement time per VM, %s (marginal %.2f ms/VM)", span, slope),
			Unit: "ms", Value: ms(hi.PlacePerVM()), AnchorName: anchor, Anchor: ms(lo.PlacePerVM()),
			Target: fmt.Sprintf("<= %.2fx (flat)", flatTarget), LowerIsBetter: true,
			Met: ms(hi.PlacePerVM()) <= flatTarget*ms(lo.PlacePerVM())})
		report.Emit(report.Result{Name: "scale: brain CPU per VM, " + span,
			Unit: "ms", Value: ms(hi.CPUPerVM()), AnchorName: anchor, Anchor: ms(lo.CPUPerVM()),
			Target: fmt.Sprintf("<= %.2fx (flat)", flatTarget), LowerIsBetter: true,
			Met: ms(hi.CPUPerVM()) <= flatTarget*ms(lo.CPUPerVM())})
	}
}

// byNodes groups fully placed points by node count, each group by VM count.
func byNodes(points []point) [][]point {
	var out [][]point
	idx := map[int]int{}
	for _, p := range points {
		if p.Placed < p.VMs {
			continue
		}
		i, ok := idx[p.Nodes]
		if !ok {
			i = len(out)
			idx[p.Nodes] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], p)
	}
	return out
}

// fit is the least-squares line through (VMs, placement seconds): the
// marginal cost in ms per VM and the fixed part in seconds.
func fit(curve []point) (slopeMs, interceptS float64) {
	var sx, sy, sxx, sxy float64
	n := float64(len(curve))
	for _, p := range curve {
		x, y := float64(p.VMs), p.Place.Seconds()
		sx, sy, sxx, sxy = sx+x, sy+y, sxx+x*x, sxy+x*y
	}
	d := n*sxx - sx*sx
	if d == 0 {
		return 0, 0
	}
	b := (n*sxy - sx*sy) / d
	return 1000 * b, (sy - b*sx) / n
}

// thousands writes n with thousands separators (10,000).
func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
