package main

import (
	"image/png"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestFitFindsTheMarginalCost(t *testing.T) {
	// 2 s fixed plus 4 ms per VM.
	var curve []point
	for _, n := range []int{1000, 5000, 10000} {
		curve = append(curve, point{Nodes: 500, VMs: n, Placed: n, Place: 2*time.Second + time.Duration(n)*4*time.Millisecond})
	}
	slope, intercept := fit(curve)
	if math.Abs(slope-4) > 1e-9 || math.Abs(intercept-2) > 1e-9 {
		t.Errorf("fit = %.6f ms/VM + %.6f s, want 4 ms/VM + 2 s", slope, intercept)
	}
}

func TestByNodesLeavesOutPartlyPlacedPoints(t *testing.T) {
	got := byNodes([]point{
		{Nodes: 100, VMs: 1000, Placed: 1000}, {Nodes: 100, VMs: 5000, Placed: 4000},
		{Nodes: 500, VMs: 1000, Placed: 1000}, {Nodes: 500, VMs: 5000, Placed: 5000},
	})
	if len(got) != 2 || len(got[0]) != 1 || len(got[1]) != 2 || got[1][1].VMs != 5000 {
		t.Errorf("byNodes = %+v", got)
	}
}

func TestThousandsAndTicks(t *testing.T) {
	for n, want := range map[int]string{7: "7", 1000: "1,000", 10000: "10,000", 1234567: "1,234,567"} {
		if got := thousands(n); got != want {
			t.Errorf("thousands(%d) = %q, want %q", n, got, want)
		}
	}
	for max, want := range map[float64]float64{10000: 2000, 60: 20, 4.4: 1, 0.3: 0.1, 0: 1} {
		if got := niceStep(max); math.Abs(got-want) > 1e-12 {
			t.Errorf("niceStep(%v) = %v, want %v", max, got, want)
		}
	}
}

func TestDrawCurveWritesThePanels(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", "scale.png")
	points := []point{
		{Nodes: 100, VMs: 1000, Placed: 1000, Place: 5 * time.Second, BrainCPU: 4 * time.Second, PeakRSS: 120, IdleAfter: 0.02},
		{Nodes: 100, VMs: 5000, Placed: 5000, Place: 30 * time.Second, BrainCPU: 22 * time.Second, PeakRSS: 260, IdleAfter: 0.03},
	}
	if err := drawCurve(path, points); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	// The first series' colour is drawn (its points and line), and so is
	// the targets' red.
	seen := map[[3]uint32]bool{}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			seen[[3]uint32{r >> 8, g >> 8, bl >> 8}] = true
		}
	}
	for _, c := range [][3]uint32{{31, 119, 180}, {200, 30, 30}, {40, 40, 40}} {
		if !seen[c] {
			t.Errorf("colour %v not drawn", c)
		}
	}
}
