package importer

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// Progress is what an import reports while it runs.
type Progress struct {
	// Bytes of the source read so far (as served: compressed bytes for a
	// compressed image).
	Bytes int64
	// Total source bytes when the source announced them, else 0.
	Total int64
	// Percent done, 0..100. When the image goes through qemu-img, reading
	// the source counts for the first half and the conversion for the
	// second.
	Percent float64
}

// String formats Percent the way DataVolume status.progress reads: "NN.NN%".
func (p Progress) String() string { return fmt.Sprintf("%.2f%%", p.Percent) }

// progressInterval is the shortest time between two reports.
const progressInterval = 200 * time.Millisecond

// tracker turns source reads and qemu-img output into Progress reports.
type tracker struct {
	mu       sync.Mutex
	report   func(Progress)
	bytes    int64
	total    int64
	twoPhase bool    // the image is converted by qemu-img after reading
	convert  float64 // qemu-img's own percent
	last     time.Time
	lastPct  float64
}

func newTracker(report func(Progress), total int64) *tracker {
	return &tracker{report: report, total: max(total, 0)}
}

func (t *tracker) percentLocked() float64 {
	var read float64
	if t.total > 0 {
		read = min(100, 100*float64(t.bytes)/float64(t.total))
	}
	if !t.twoPhase {
		return read
	}
	return read/2 + t.convert/2
}

func (t *tracker) emitLocked(force bool) {
	if t.report == nil {
		return
	}
	pct := t.percentLocked()
	now := time.Now()
	if !force && (now.Sub(t.last) < progressInterval || pct == t.lastPct) {
		return
	}
	t.last, t.lastPct = now, pct
	t.report(Progress{Bytes: t.bytes, Total: t.total, Percent: pct})
}

func (t *tracker) addBytes(n int64) {
	t.mu.Lock()
	t.bytes += n
	t.emitLocked(false)
	t.mu.Unlock()
}

// setTotal fixes the total when it becomes known late (registry layers).
func (t *tracker) setTotal(n int64) {
	t.mu.Lock()
	t.total = max(n, 0)
	t.mu.Unlock()
}

func (t *tracker) setTwoPhase() {
	t.mu.Lock()
	t.twoPhase = true
	t.mu.Unlock()
}

func (t *tracker) setConvert(pct float64) {
	t.mu.Lock()
	t.convert = pct
	t.emitLocked(false)
	t.mu.Unlock()
}

// read is the number of source bytes read so far.
func (t *tracker) read() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.bytes
}

// done reports 100%.
func (t *tracker) done() {
	t.mu.Lock()
	if t.total == 0 || t.bytes > t.total {
		t.total = t.bytes
	}
	t.bytes, t.convert = t.total, 100
	t.emitLocked(true)
	t.mu.Unlock()
}

// countingReader reports every read to a tracker.
type countingReader struct {
	r io.Reader
	t *tracker
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 {
		c.t.addBytes(int64(n))
	}
	return n, err
}
