package importer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// holeBlock is the granularity at which all-zero data is skipped instead of
// written, leaving holes in a file and pre-zeroed blocks on a device.
const holeBlock = 4096

// zeroBlock is what isZero compares with: one hole's worth, kept out of
// the heap (a daemon-lifetime buffer there would raise every GC's target).
var zeroBlock [holeBlock]byte

// destination is where the guest-visible raw content goes. A file is
// written under a temporary name in its directory and renamed over the
// final path by commit; a block device is zeroed over the image's range
// before writing, and zeroed again over what was written if the import is
// aborted. Writes beyond capacity fail with ReasonTooLarge, which is what
// stops a decompression bomb.
type destination struct {
	path     string
	block    bool
	capacity int64
	f        *os.File
	tmp      string // file destinations: the temporary name
	size     int64  // the image size the destination ends up with
	written  int64  // highest offset written + 1
	zeroed   int64  // block destinations: bytes zeroed from 0
}

func openDestination(path string, block bool, capacity int64) (*destination, error) {
	d := &destination{path: path, block: block, capacity: capacity}
	if block {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_EXCL, 0)
		if err != nil {
			return nil, failf(ReasonDestination, "open block device: %w", err)
		}
		var devSize uint64
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&devSize))); errno != 0 {
			f.Close()
			return nil, failf(ReasonDestination, "size of %s: %w", path, errno)
		}
		if d.capacity == 0 {
			d.capacity = int64(devSize)
		}
		if d.capacity > int64(devSize) {
			f.Close()
			return nil, failf(ReasonInvalidRequest, "capacity %d exceeds device %s size %d", d.capacity, path, devSize)
		}
		d.f = f
		return d, nil
	}
	if capacity <= 0 {
		return nil, failf(ReasonInvalidRequest, "capacity is required for a file destination")
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".importing-*")
	if err != nil {
		return nil, failf(ReasonDestination, "create temporary file: %w", err)
	}
	d.f, d.tmp = f, f.Name()
	return d, nil
}

// writePath is the path a child process (qemu-img) should write to.
func (d *destination) writePath() string {
	if d.block {
		return d.path
	}
	return d.tmp
}

// setSize declares the image size before any write: it is checked against
// the capacity, a file is sized to it (sparse), a device range is zeroed.
func (d *destination) setSize(size int64) error {
	if size > d.capacity {
		return failf(ReasonTooLarge, "image virtual size %d exceeds destination capacity %d", size, d.capacity)
	}
	d.size = size
	if d.block {
		return d.zeroUpTo(size)
	}
	if err := d.f.Truncate(size); err != nil {
		return failf(ReasonDestination, "size destination: %w", err)
	}
	return nil
}

// zeroUpTo zeroes the device from d.zeroed up to end.
func (d *destination) zeroUpTo(end int64) error {
	if end <= d.zeroed {
		return nil
	}
	if err := zeroDeviceRange(d.f, d.zeroed, end-d.zeroed); err != nil {
		return failf(ReasonDestination, "zero %s: %w", d.path, err)
	}
	d.zeroed = end
	return nil
}

// WriteAt writes p at off, skipping all-zero blocks (the destination reads
// zero there already).
func (d *destination) WriteAt(p []byte, off int64) (int, error) {
	end := off + int64(len(p))
	if end > d.capacity {
		return 0, failf(ReasonTooLarge, "image data beyond destination capacity %d", d.capacity)
	}
	if d.block && end > d.zeroed {
		// A stream of unknown length: zero ahead in large steps.
		if err := d.zeroUpTo(min(d.capacity, max(end, d.zeroed+(256<<20)))); err != nil {
			return 0, err
		}
	}
	for i := 0; i < len(p); {
		// Find the next run of non-zero blocks and write it in one call.
		for i < len(p) && isZero(p[i:min(i+holeBlock, len(p))]) {
			i += holeBlock
		}
		if i >= len(p) {
			break
		}
		j := i
		for j < len(p) && !isZero(p[j:min(j+holeBlock, len(p))]) {
			j += holeBlock
		}
		j = min(j, len(p))
		if _, err := d.f.WriteAt(p[i:j], off+int64(i)); err != nil {
			return 0, failf(ReasonDestination, "write destination: %w", err)
		}
		i = j
	}
	if end > d.written {
		d.written = end
	}
	return len(p), nil
}

func isZero(b []byte) bool {
	for len(b) > 0 {
		n := min(len(b), len(zeroBlock))
		if !bytes.Equal(b[:n], zeroBlock[:n]) {
			return false
		}
		b = b[n:]
	}
	return true
}

// finishSize fixes the final size of a stream whose length was not known
// in advance.
func (d *destination) finishSize(size int64) error {
	d.size = size
	if d.block {
		return nil
	}
	if err := d.f.Truncate(size); err != nil {
		return failf(ReasonDestination, "size destination: %w", err)
	}
	return nil
}

// commit makes the import durable and visible under its final name. grow,
// when larger than the image size, extends a file destination (sparse).
func (d *destination) commit(grow int64) error {
	if !d.block && grow > d.size {
		if err := d.f.Truncate(grow); err != nil {
			return failf(ReasonDestination, "grow destination: %w", err)
		}
	}
	if err := d.f.Sync(); err != nil {
		return failf(ReasonDestination, "sync destination: %w", err)
	}
	if err := d.f.Close(); err != nil {
		return failf(ReasonDestination, "close destination: %w", err)
	}
	d.f = nil
	if d.block {
		return nil
	}
	if err := os.Rename(d.tmp, d.path); err != nil {
		return failf(ReasonDestination, "rename into place: %w", err)
	}
	if dir, err := os.Open(filepath.Dir(d.path)); err == nil {
		_ = dir.Sync()
		dir.Close()
	}
	return nil
}

// abort removes everything the import wrote: the temporary file, or the
// written range of the device (zeroed again).
func (d *destination) abort() error {
	if d.f == nil {
		return nil
	}
	var errs []error
	if d.block {
		if n := max(d.written, d.zeroed); n > 0 {
			if err := zeroDeviceRange(d.f, 0, n); err != nil {
				errs = append(errs, fmt.Errorf("zero written range of %s: %w", d.path, err))
			}
		}
		errs = append(errs, d.f.Close())
	} else {
		errs = append(errs, d.f.Close())
		if err := os.Remove(d.tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	d.f = nil
	return errors.Join(errs...)
}

// zeroDeviceRange zeroes [off, off+n) of a block device with BLKZEROOUT,
// which the kernel turns into write-zeroes/discard where the device has
// them and into plain zero writes otherwise.
func zeroDeviceRange(f *os.File, off, n int64) error {
	r := [2]uint64{uint64(off), uint64(n)}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKZEROOUT, uintptr(unsafe.Pointer(&r))); errno != 0 {
		return errno
	}
	return nil
}

// sequentialWriter turns a stream into WriteAt calls from offset 0 and
// remembers the last 512 bytes (a fixed VHD's footer).
type sequentialWriter struct {
	d    *destination
	off  int64
	tail [512]byte
}

var _ io.Writer = (*sequentialWriter)(nil)

func (w *sequentialWriter) Write(p []byte) (int, error) {
	n, err := w.d.WriteAt(p, w.off)
	w.off += int64(n)
	if len(p) >= len(w.tail) {
		copy(w.tail[:], p[len(p)-len(w.tail):])
	} else {
		copy(w.tail[:], w.tail[len(p):])
		copy(w.tail[len(w.tail)-len(p):], p)
	}
	return n, err
}

// RemoveLeftovers removes what an import into the file dest that was
// interrupted (the node agent killed or restarted mid-way) left next to
// it: the temporary destination, a download awaiting qemu-img, a qcow2
// spill file. The final dest itself is kept. Call it before importing
// into dest again; nothing may be importing into dest meanwhile.
func RemoveLeftovers(dest string) error {
	dir, base := filepath.Dir(dest), filepath.Base(dest)
	var errs []error
	for _, pattern := range []string{"." + base + ".importing-*", "." + base + ".download.importing-*", "." + base + ".spill-*"} {
		matches, err := filepath.Glob(filepath.Join(dir, globEscape(pattern)))
		if err != nil {
			return err
		}
		for _, m := range matches {
			if err := os.Remove(m); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// globEscape escapes the glob metacharacters of a file name, keeping the
// trailing "*" of a pattern.
func globEscape(pattern string) string {
	stem, star := strings.CutSuffix(pattern, "*")
	var b strings.Builder
	for _, r := range stem {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	if star {
		b.WriteByte('*')
	}
	return b.String()
}
