package importer

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
)

// peakHeap runs f and returns how far the live heap grew above where it
// was before, sampled every 10 ms.
func peakHeap(t *testing.T, f func()) uint64 {
	t.Helper()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	var peak atomic.Uint64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > peak.Load() {
				peak.Store(ms.HeapAlloc)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	f()
	close(stop)
	<-done
	if p := peak.Load(); p > base {
		return p - base
	}
	return 0
}

// denseQcow2 is a hostile qcow2 stream: a 1 TiB virtual disk in 64 KiB
// clusters whose L2 tables all come first, each entry pointing at a
// distinct data cluster far ahead. Streaming it would have to remember
// every one of those 8192 entries per table. The stream is generated as
// it is read, so that the test's own memory does not count.
func denseQcow2(tables int) io.Reader {
	return &denseReader{tables: tables, buf: make([]byte, denseCS)}
}

const denseCS = 64 << 10

type denseReader struct {
	tables int
	k      int // next cluster to generate
	buf    []byte
	rest   []byte
}

func (d *denseReader) Read(p []byte) (int, error) {
	const size = 1 << 40
	l1Entries := size / (denseCS * (denseCS / 8))
	be := binary.BigEndian
	if len(d.rest) == 0 {
		if d.k >= d.tables+2 {
			return 0, io.EOF
		}
		b := d.buf
		clear(b)
		switch {
		case d.k == 0:
			copy(b, magicQcow2)
			be.PutUint32(b[4:], 3)
			be.PutUint32(b[20:], 16)
			be.PutUint64(b[24:], size)
			be.PutUint32(b[36:], uint32(l1Entries))
			be.PutUint64(b[40:], denseCS) // L1 at cluster 1
			be.PutUint32(b[96:], 4)       // refcount order
			be.PutUint32(b[100:], 104)
		case d.k == 1:
			for i := range d.tables {
				be.PutUint64(b[8*i:], uint64((2+i)*denseCS))
			}
		default:
			i := d.k - 2
			dataStart := 2 + l1Entries
			for j := range denseCS / 8 {
				be.PutUint64(b[8*j:], uint64((dataStart+i*(denseCS/8)+j)*denseCS))
			}
		}
		d.k++
		d.rest = b
	}
	n := copy(p, d.rest)
	d.rest = d.rest[n:]
	return n, nil
}

// TestHostileQcow2MemoryIsBounded: 200 dense L2 tables (1.6 million data
// clusters announced ahead, 13 MiB of stream) stop at the tracking budget
// with a clear reason, and the heap stays within a fixed bound.
func TestHostileQcow2MemoryIsBounded(t *testing.T) {
	var err error
	grew := peakHeap(t, func() {
		_, err = ImportFromReader(context.Background(), denseQcow2(200), -1,
			Request{Dest: filepath.Join(t.TempDir(), "disk.img"), Capacity: 2 << 40})
	})
	wantReason(t, err, ReasonUnsupportedImage)
	t.Logf("heap grew by %d MiB before the import stopped: %v", grew>>20, err)
	if grew > 48<<20 {
		t.Errorf("heap grew by %d MiB, budget 48 MiB", grew>>20)
	}
}

// TestZstdBombMemoryIsBounded: 1 GiB of zeros in a few KiB of zstd stop at
// the capacity, with the decoder's memory bounded.
func TestZstdBombMemoryIsBounded(t *testing.T) {
	var bomb bytes.Buffer
	zw, _ := zstd.NewWriter(&bomb, zstd.WithEncoderLevel(zstd.SpeedBestCompression))
	zeros := make([]byte, 1<<20)
	for range 1024 {
		zw.Write(zeros)
	}
	zw.Close()
	var err error
	grew := peakHeap(t, func() {
		_, err = ImportFromReader(context.Background(), bytes.NewReader(bomb.Bytes()), int64(bomb.Len()),
			Request{Dest: filepath.Join(t.TempDir(), "disk.img"), Capacity: 16 << 20})
	})
	wantReason(t, err, ReasonTooLarge)
	t.Logf("zstd bomb of %d bytes: heap grew by %d MiB", bomb.Len(), grew>>20)
	if grew > 48<<20 {
		t.Errorf("heap grew by %d MiB, budget 48 MiB", grew>>20)
	}
}
