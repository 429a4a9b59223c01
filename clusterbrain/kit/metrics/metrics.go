// Package metrics is a small Prometheus registry with the text exposition
// format (version 0.0.4): counters, gauges and histograms with labels, and
// collectors computed at scrape time, plus what both daemons expose the same
// way: the reconcile counter of every controller, KubeVirt's VMI info and
// phase-count families (VMICollector) and a /metrics Server. Both the brain
// and the node agent serve it; the node's libvirt domain statistics are the
// node agent's own (nodeagent/metrics).
package metrics

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// Metric types.
const (
	TypeCounter   = "counter"
	TypeGauge     = "gauge"
	TypeHistogram = "histogram"
)

// Label is one label pair.
type Label struct{ Name, Value string }

// Sample is one exposed line: the family name plus an optional suffix
// (_bucket, _sum, _count), its labels and value.
type Sample struct {
	Suffix string
	Labels []Label
	Value  float64
}

// Family is a metric family as exposed.
type Family struct {
	Name, Help, Type string
	Samples          []Sample
}

// Collector produces families at scrape time.
type Collector interface {
	Collect() []Family
}

// CollectorFunc adapts a function.
type CollectorFunc func() []Family

// Collect implements Collector.
func (f CollectorFunc) Collect() []Family { return f() }

// Registry holds metrics and collectors.
type Registry struct {
	mu         sync.Mutex
	vecs       map[string]*vec
	collectors []Collector
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{vecs: map[string]*vec{}} }

var defaultRegistry = NewRegistry()

// Default is the process-wide registry the daemons serve; packages add
// their metrics to it (as client_golang's default registerer).
func Default() *Registry { return defaultRegistry }

// Register adds a collector.
func (r *Registry) Register(c Collector) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.collectors = append(r.collectors, c)
}

type vec struct {
	name, help, typ string
	labels          []string
	buckets         []float64
	mu              sync.Mutex
	series          map[string]*series
}

type series struct {
	labels []Label
	mu     sync.Mutex
	value  float64
	counts []uint64 // histogram: per bucket (not cumulative)
	sum    float64
	count  uint64
}

func (r *Registry) vec(name, help, typ string, buckets []float64, labels []string) *vec {
	r.mu.Lock()
	defer r.mu.Unlock()
	if v, ok := r.vecs[name]; ok {
		if v.typ != typ || strings.Join(v.labels, ",") != strings.Join(labels, ",") {
			panic(fmt.Sprintf("metrics: %s registered again with another type or labels", name))
		}
		return v
	}
	v := &vec{name: name, help: help, typ: typ, labels: labels, buckets: buckets, series: map[string]*series{}}
	r.vecs[name] = v
	return v
}

func (v *vec) with(values []string) *series {
	if len(values) != len(v.labels) {
		panic(fmt.Sprintf("metrics: %s wants %d label values, got %d", v.name, len(v.labels), len(values)))
	}
	key := strings.Join(values, "\xff")
	v.mu.Lock()
	defer v.mu.Unlock()
	s, ok := v.series[key]
	if !ok {
		s = &series{}
		for i, n := range v.labels {
			s.labels = append(s.labels, Label{n, values[i]})
		}
		if v.typ == TypeHistogram {
			s.counts = make([]uint64, len(v.buckets))
		}
		v.series[key] = s
	}
	return s
}

// Delete drops the series with these label values (a deleted VMI).
func (v *vec) delete(values []string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	delete(v.series, strings.Join(values, "\xff"))
}

// CounterVec is a counter family.
type CounterVec struct{ v *vec }

// Counter returns (creating once) the counter family name.
func (r *Registry) Counter(name, help string, labels ...string) *CounterVec {
	return &CounterVec{r.vec(name, help, TypeCounter, nil, labels)}
}

// Counter is one counter series.
type Counter struct{ s *series }

// With returns the series of these label values.
func (c *CounterVec) With(values ...string) Counter { return Counter{c.v.with(values)} }

// Delete removes a series.
func (c *CounterVec) Delete(values ...string) { c.v.delete(values) }

// Inc adds one.
func (c Counter) Inc() { c.Add(1) }

// Add adds d, which must not be negative.
func (c Counter) Add(d float64) {
	if d < 0 {
		return
	}
	c.s.mu.Lock()
	c.s.value += d
	c.s.mu.Unlock()
}

// GaugeVec is a gauge family.
type GaugeVec struct{ v *vec }

// Gauge returns (creating once) the gauge family name.
func (r *Registry) Gauge(name, help string, labels ...string) *GaugeVec {
	return &GaugeVec{r.vec(name, help, TypeGauge, nil, labels)}
}

// Gauge is one gauge series.
type Gauge struct{ s *series }

// With returns the series of these label values.
func (g *GaugeVec) With(values ...string) Gauge { return Gauge{g.v.with(values)} }

// Delete removes a series.
func (g *GaugeVec) Delete(values ...string) { g.v.delete(values) }

// Set sets the value.
func (g Gauge) Set(v float64) { g.s.mu.Lock(); g.s.value = v; g.s.mu.Unlock() }

// Add adds d (may be negative).
func (g Gauge) Add(d float64) { g.s.mu.Lock(); g.s.value += d; g.s.mu.Unlock() }

// HistogramVec is a histogram family.
type HistogramVec struct{ v *vec }

// Histogram returns (creating once) the histogram family name with the
// given upper bounds (sorted; +Inf is implied).
func (r *Registry) Histogram(name, help string, buckets []float64, labels ...string) *HistogramVec {
	b := append([]float64(nil), buckets...)
	sort.Float64s(b)
	return &HistogramVec{r.vec(name, help, TypeHistogram, b, labels)}
}

// Histogram is one histogram series.
type Histogram struct {
	s       *series
	buckets []float64
}

// With returns the series of these label values.
func (h *HistogramVec) With(values ...string) Histogram {
	return Histogram{h.v.with(values), h.v.buckets}
}

// Observe records one value.
func (h Histogram) Observe(v float64) {
	i := sort.SearchFloat64s(h.buckets, v)
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	if i < len(h.s.counts) {
		h.s.counts[i]++
	}
	h.s.sum += v
	h.s.count++
}

// LatencyBuckets suit operation latencies in seconds (CNI, CSI, imports):
// 1 ms to 60 s.
var LatencyBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

func (v *vec) family() Family {
	f := Family{Name: v.name, Help: v.help, Type: v.typ}
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, s := range v.series {
		s.mu.Lock()
		if v.typ != TypeHistogram {
			f.Samples = append(f.Samples, Sample{Labels: s.labels, Value: s.value})
			s.mu.Unlock()
			continue
		}
		var cum uint64
		for i, b := range v.buckets {
			cum += s.counts[i]
			f.Samples = append(f.Samples, Sample{Suffix: "_bucket", Labels: withLabel(s.labels, "le", formatFloat(b)), Value: float64(cum)})
		}
		f.Samples = append(f.Samples,
			Sample{Suffix: "_bucket", Labels: withLabel(s.labels, "le", "+Inf"), Value: float64(s.count)},
			Sample{Suffix: "_sum", Labels: s.labels, Value: s.sum},
			Sample{Suffix: "_count", Labels: s.labels, Value: float64(s.count)})
		s.mu.Unlock()
	}
	return f
}

func withLabel(ls []Label, name, value string) []Label {
	return append(append([]Label(nil), ls...), Label{name, value})
}

// Gather returns every family, sorted by name, samples sorted by labels.
// Families of the same name from several collectors are merged.
func (r *Registry) Gather() []Family {
	r.mu.Lock()
	vecs := make([]*vec, 0, len(r.vecs))
	for _, v := range r.vecs {
		vecs = append(vecs, v)
	}
	collectors := append([]Collector(nil), r.collectors...)
	r.mu.Unlock()
	byName := map[string]*Family{}
	add := func(f Family) {
		if cur, ok := byName[f.Name]; ok {
			cur.Samples = append(cur.Samples, f.Samples...)
			return
		}
		byName[f.Name] = &f
	}
	for _, v := range vecs {
		add(v.family())
	}
	for _, c := range collectors {
		for _, f := range c.Collect() {
			add(f)
		}
	}
	out := make([]Family, 0, len(byName))
	for _, f := range byName {
		sort.SliceStable(f.Samples, func(i, j int) bool { return sampleKey(f.Samples[i]) < sampleKey(f.Samples[j]) })
		out = append(out, *f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func sampleKey(s Sample) string {
	var b strings.Builder
	for _, l := range s.Labels {
		if l.Name == "le" {
			continue // keep buckets in bound order
		}
		b.WriteString(l.Value)
		b.WriteByte(0)
	}
	if s.Suffix != "_bucket" {
		b.WriteString("\xff" + s.Suffix)
	}
	return b.String()
}

// WriteText writes the families in the Prometheus text format.
func WriteText(w io.Writer, families []Family) error {
	var b strings.Builder
	for _, f := range families {
		if len(f.Samples) == 0 {
			continue
		}
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", f.Name, escapeHelp(f.Help), f.Name, f.Type)
		for _, s := range f.Samples {
			b.WriteString(f.Name + s.Suffix)
			if len(s.Labels) > 0 {
				b.WriteByte('{')
				for i, l := range s.Labels {
					if i > 0 {
						b.WriteByte(',')
					}
					b.WriteString(l.Name + `="` + escapeValue(l.Value) + `"`)
				}
				b.WriteByte('}')
			}
			b.WriteString(" " + formatFloat(s.Value) + "\n")
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	if v == math.Trunc(v) && math.Abs(v) < 1e15 {
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

var (
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
	valueEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)
)

func escapeHelp(s string) string  { return helpEscaper.Replace(s) }
func escapeValue(s string) string { return valueEscaper.Replace(s) }

// Handler serves the registry in the text format.
func (r *Registry) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_ = WriteText(w, r.Gather())
	})
}
