package main

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
	"time"
)

// series is one line of a panel: points (x, y) in data units.
type series struct {
	label string
	color color.RGBA
	xy    [][2]float64
}

// panel is one chart: its series against the VM count, and an optional
// target drawn dashed (a horizontal line, or through the origin with
// slope targetSlope).
type panel struct {
	title       string
	series      []series
	target      float64
	targetSlope float64
	targetLabel string
}

var (
	white   = color.RGBA{255, 255, 255, 255}
	ink     = color.RGBA{40, 40, 40, 255}
	grid    = color.RGBA{225, 225, 225, 255}
	red     = color.RGBA{200, 30, 30, 255}
	palette = []color.RGBA{{31, 119, 180, 255}, {255, 127, 14, 255}, {44, 160, 44, 255}, {148, 103, 189, 255}}
)

// drawCurve draws four panels — placement time, per-VM cost, peak RSS and
// idle CPU against the VM count, a line per node count — into a PNG.
func drawCurve(path string, points []point) error {
	byN := map[int][]point{}
	var nodeCounts []int
	for _, p := range points {
		if _, ok := byN[p.Nodes]; !ok {
			nodeCounts = append(nodeCounts, p.Nodes)
		}
		byN[p.Nodes] = append(byN[p.Nodes], p)
	}
	line := func(f func(point) float64, suffix string, shade int) []series {
		var out []series
		for i, n := range nodeCounts {
			s := series{label: fmt.Sprintf("%d nodes%s", n, suffix), color: palette[(i+shade)%len(palette)]}
			for _, p := range byN[n] {
				s.xy = append(s.xy, [2]float64{float64(p.VMs), f(p)})
			}
			out = append(out, s)
		}
		return out
	}
	panels := []panel{
		{title: "time to schedule all VMs (s)", series: line(func(p point) float64 { return p.Place.Seconds() }, "", 0),
			targetSlope: placePerVMTarget.Seconds(), targetLabel: "target 6 ms/VM"},
		{title: "per VM (ms): placement, brain CPU", series: append(
			line(func(p point) float64 { return ms(p.PlacePerVM()) }, " place", 0),
			line(func(p point) float64 { return ms(p.CPUPerVM()) }, " cpu", 2)...)},
		{title: "brain peak RSS (MiB)", series: line(func(p point) float64 { return p.PeakRSS }, "", 0),
			target: rssTarget, targetLabel: "target 400"},
		{title: "idle brain CPU, all VMIs present (% of a core)", series: line(func(p point) float64 { return 100 * p.IdleAfter }, "", 0),
			target: 100 * idleTarget, targetLabel: "target 5"},
	}
	const w, h, scale = 1400, 980, 2
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	draw.Draw(img, img.Bounds(), &image.Uniform{white}, image.Point{}, draw.Src)
	drawText(img, 30, 16, "nodevirt brain scale curve, "+time.Now().UTC().Format("2006-01-02 15:04 UTC")+
		", simulated nodes, x: VMs created at once", scale, ink)
	for i, pn := range panels {
		x0, y0 := 20+(i%2)*(w/2), 60+(i/2)*((h-60)/2)
		pn.draw(img, image.Rect(x0, y0, x0+w/2-40, y0+(h-60)/2-20), scale)
	}
	if err := ensureDir(path); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// draw renders the panel into r.
func (pn panel) draw(img *image.RGBA, r image.Rectangle, scale int) {
	drawText(img, r.Min.X, r.Min.Y, pn.title, scale, ink)
	var xmax, ymax float64
	for _, s := range pn.series {
		for _, p := range s.xy {
			xmax, ymax = math.Max(xmax, p[0]), math.Max(ymax, p[1])
		}
	}
	if pn.target > 0 {
		ymax = math.Max(ymax, pn.target*1.1)
	}
	xstep, ystep := niceStep(xmax), niceStep(ymax)
	xmax, ymax = xstep*math.Ceil(xmax/xstep), ystep*math.Ceil(ymax/ystep)
	plot := image.Rect(r.Min.X+80, r.Min.Y+30, r.Max.X-10, r.Max.Y-40)
	px := func(x float64) int { return plot.Min.X + int(x/xmax*float64(plot.Dx())) }
	py := func(y float64) int { return plot.Max.Y - int(y/ymax*float64(plot.Dy())) }
	for y := 0.0; y <= ymax+ystep/2; y += ystep {
		hline(img, plot.Min.X, plot.Max.X, py(y), grid)
		label := tickLabel(y, ystep)
		drawText(img, plot.Min.X-8-textWidth(label, scale), py(y)-7, label, scale, ink)
	}
	for x := 0.0; x <= xmax+xstep/2; x += xstep {
		vline(img, px(x), plot.Min.Y, plot.Max.Y, grid)
		label := tickLabel(x, xstep)
		drawText(img, px(x)-textWidth(label, scale)/2, plot.Max.Y+8, label, scale, ink)
	}
	hline(img, plot.Min.X, plot.Max.X, plot.Max.Y, ink)
	vline(img, plot.Min.X, plot.Min.Y, plot.Max.Y, ink)
	switch {
	case pn.target > 0:
		dashed(img, px(0), py(pn.target), px(xmax), py(pn.target), red)
		drawText(img, plot.Max.X-textWidth(pn.targetLabel, scale), py(pn.target)-18, pn.targetLabel, scale, red)
	case pn.targetSlope > 0:
		xEnd := math.Min(xmax, ymax/pn.targetSlope)
		dashed(img, px(0), py(0), px(xEnd), py(xEnd*pn.targetSlope), red)
		drawText(img, px(xEnd)-textWidth(pn.targetLabel, scale), py(xEnd*pn.targetSlope)+6, pn.targetLabel, scale, red)
	}
	for i, s := range pn.series {
		for j, p := range s.xy {
			x, y := px(p[0]), py(p[1])
			for dy := -3; dy <= 3; dy++ {
				for dx := -3; dx <= 3; dx++ {
					img.Set(x+dx, y+dy, s.color)
				}
			}
			if j > 0 {
				segment(img, px(s.xy[j-1][0]), py(s.xy[j-1][1]), x, y, s.color, false)
			}
		}
		ly := plot.Min.Y + 6 + i*20
		hline(img, plot.Min.X+12, plot.Min.X+36, ly+6, s.color)
		hline(img, plot.Min.X+12, plot.Min.X+36, ly+7, s.color)
		drawText(img, plot.Min.X+44, ly, s.label, scale, s.color)
	}
}

// niceStep is a tick step of 1, 2 or 5 × 10^k giving about five ticks up
// to max.
func niceStep(max float64) float64 {
	if max <= 0 {
		return 1
	}
	raw := max / 5
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if raw <= m*mag {
			return m * mag
		}
	}
	return 10 * mag
}

func tickLabel(v, step float64) string {
	switch {
	case step >= 1:
		return fmt.Sprintf("%.0f", v)
	case step >= 0.1:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

func hline(img *image.RGBA, x0, x1, y int, c color.Color) {
	for x := x0; x <= x1; x++ {
		img.Set(x, y, c)
	}
}

func vline(img *image.RGBA, x, y0, y1 int, c color.Color) {
	for y := y0; y <= y1; y++ {
		img.Set(x, y, c)
	}
}

func dashed(img *image.RGBA, x0, y0, x1, y1 int, c color.Color) {
	segment(img, x0, y0, x1, y1, c, true)
}

// segment draws a two-pixel line from (x0, y0) to (x1, y1), dashed or not.
func segment(img *image.RGBA, x0, y0, x1, y1 int, c color.Color, dash bool) {
	n := max(abs(x1-x0), abs(y1-y0), 1)
	for i := 0; i <= n; i++ {
		if dash && (i/8)%2 == 1 {
			continue
		}
		x := x0 + (x1-x0)*i/n
		y := y0 + (y1-y0)*i/n
		img.Set(x, y, c)
		img.Set(x+1, y, c)
		img.Set(x, y+1, c)
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}
