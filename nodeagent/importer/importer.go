// Package importer writes a VM disk image into a destination on this node:
// a raw image file inside a filesystem volume, or a block device. It is
// CDI's importer without the pod and, where the format allows, without the
// scratch copy.
//
// Sources are an HTTP(S) URL, a container registry image laid out like a
// KubeVirt containerDisk, a blank disk, or any reader (upload bodies).
// Formats are recognised by their magic bytes, and only an allowlist is
// written (vet.go): raw and iso; qcow2 without backing file, external data
// file or encryption; VMDK monolithicSparse/streamOptimized whose one
// extent is the image itself; VHD (fixed, dynamic) and VHDX without
// parent; each possibly wrapped in gz, xz, zstd or bz2. Anything else with
// a recognised header (VMDK descriptors, multi-extent VMDKs, VDI,
// differencing images) fails with ReasonUnsupportedImage naming what it
// references, before a byte reaches the destination or qemu-img.
//
// What streams (one pass over the source, written once, zero blocks left as
// holes): raw and iso, compressed or not; qcow2 (v2/v3, uncompressed or
// deflate/zstd-compressed clusters, no extended L2) is converted in Go as
// it arrives. Clusters that arrive before the table that places them are
// parked in a spill file in the work directory; images made by qemu-img
// never need it.
//
// What does not stream: vmdk, vhd, vhdx and qcow2 images with extended L2
// entries need random access. They are downloaded (sparse) into the work
// directory, vetted again (the VMDK embedded descriptor, the VHDX
// metadata, then `qemu-img info` whose backing file, data file, children
// and extents are checked) and converted with `qemu-img convert`, whose
// progress is reported. qemu-img always gets an explicit format (never
// probes) and runs confined (package confine): a private mount namespace
// showing only the download and the destination, no network, uid nobody,
// CPU and address-space limits, killed with its process group on cancel.
//
// Binaries used: qemu-img (Debian qemu-utils) for the non-streaming
// formats, xz (xz-utils, confined like qemu-img) for xz streams,
// util-linux's unshare/prlimit/mount for the confinement; gzip, zstd and
// bzip2 are decoded in Go.
//
// Network reach (package reach, shared with the brain): an HTTP or
// registry import may not connect to loopback, link-local (cloud metadata)
// or this node's own addresses unless the request allows them; the check
// runs on every dialed address. Registries are spoken to through the
// shared OCI distribution client (package registry); this package finds
// the disk in the layers and imports it.
//
// Safety: the virtual size is checked against the capacity before the
// destination is written (content length for raw, header for the others);
// a failed import leaves no file behind (files are written under a
// temporary name and renamed at the end) and zeroes what it wrote on a
// device; a decompressed stream stops at the capacity. Every failure is an
// *Error whose Reason can be used as a DataVolume condition reason.
package importer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
)

// Source says where the image comes from. Exactly one field is set.
type Source struct {
	HTTP     *HTTPSource
	Registry *RegistrySource
	// Blank makes an empty (all-zero) disk of the request's capacity.
	Blank bool
}

// Request is one import.
type Request struct {
	Source
	// Dest is the destination: the path of the raw image file to create
	// (its directory must exist), or a block device path.
	Dest        string
	DestIsBlock bool
	// Capacity is the usable size of the destination in bytes, already net
	// of any filesystem overhead. Required for files; for a block device 0
	// means the device's size.
	Capacity int64
	// ExpandToCapacity grows a file destination to Capacity after the
	// import (CDI's behaviour of filling the volume); otherwise the file has
	// the image's virtual size. Blank disks always have Capacity.
	ExpandToCapacity bool
	// WorkDir receives downloads of formats that need random access (and
	// qcow2 spill data). Empty means the destination file's directory; a
	// block destination without WorkDir fails such images with
	// ReasonScratchRequired.
	WorkDir string
	// Raw copies the source byte for byte as a raw disk: no decompression,
	// no format detection, no footer handling. Clones set it: the bytes of
	// a volume are what its guest wrote, and a guest may write any header.
	Raw bool
	// Progress, when set, is called from the importing goroutine at most
	// every 200ms and once at 100%.
	Progress func(Progress)
	// Logger, when set, receives debug lines; nil discards them.
	Logger *slog.Logger
}

// Result describes a finished import.
type Result struct {
	Format      Format
	Compression Compression
	// VirtualSize is the guest-visible size of the image written.
	VirtualSize int64
	// SourceBytes is how many bytes were read from the source.
	SourceBytes int64
	// Streamed is false when the image went through a work-directory
	// download and qemu-img.
	Streamed bool
}

// Import runs req to completion. On error nothing of the import remains in
// the destination, and the error is an *Error (see ReasonOf).
func Import(ctx context.Context, req Request) (res Result, err error) {
	defer func() { err = asImportError(ctx, err) }()
	if err := req.validate(true); err != nil {
		return Result{}, err
	}
	switch {
	case req.Blank:
		return importBlank(req)
	case req.HTTP != nil:
		return importHTTP(ctx, req)
	default:
		return importRegistry(ctx, req)
	}
}

// ImportFromReader imports the image read from r (an upload body, a clone
// source). size is the stream length, or -1 when unknown; req.Source is
// ignored.
func ImportFromReader(ctx context.Context, r io.Reader, size int64, req Request) (res Result, err error) {
	defer func() { err = asImportError(ctx, err) }()
	if err := req.validate(false); err != nil {
		return Result{}, err
	}
	t := newTracker(req.Progress, size)
	return importStream(ctx, req, &countingReader{r: r, t: t}, size, t, nil)
}

func (req *Request) validate(needSource bool) error {
	if req.Dest == "" {
		return failf(ReasonInvalidRequest, "no destination")
	}
	if !req.DestIsBlock && req.Capacity <= 0 {
		return failf(ReasonInvalidRequest, "capacity is required for a file destination")
	}
	if req.Capacity < 0 {
		return failf(ReasonInvalidRequest, "negative capacity")
	}
	if !needSource {
		return nil
	}
	n := 0
	if req.HTTP != nil {
		n++
		if _, _, err := parseChecksum(req.HTTP.Checksum); err != nil {
			return err
		}
	}
	if req.Registry != nil {
		n++
	}
	if req.Blank {
		n++
	}
	if n != 1 {
		return failf(ReasonInvalidRequest, "exactly one source is required, got %d", n)
	}
	return nil
}

func (req *Request) logger() *slog.Logger {
	if req.Logger != nil {
		return req.Logger
	}
	return slog.New(slog.DiscardHandler)
}

// workDir is where downloads and spill files go, or "" if nowhere.
func (req *Request) workDir() string {
	if req.WorkDir != "" {
		return req.WorkDir
	}
	if !req.DestIsBlock {
		return filepath.Dir(req.Dest)
	}
	return ""
}

func importBlank(req Request) (Result, error) {
	d, err := openDestination(req.Dest, req.DestIsBlock, req.Capacity)
	if err != nil {
		return Result{}, err
	}
	if err := d.setSize(d.capacity); err != nil {
		return Result{}, errors.Join(err, d.abort())
	}
	if err := d.commit(0); err != nil {
		return Result{}, errors.Join(err, d.abort())
	}
	newTracker(req.Progress, 0).done()
	return Result{Format: FormatRaw, VirtualSize: d.capacity, Streamed: true}, nil
}

// importStream writes the image read from src into the destination. total
// is src's length or -1; the caller counts source bytes into t. finish,
// when set, runs after the image is written and before it is committed:
// it drains and verifies the source.
func importStream(ctx context.Context, req Request, src io.Reader, total int64, t *tracker, finish func() error) (Result, error) {
	d, err := openDestination(req.Dest, req.DestIsBlock, req.Capacity)
	if err != nil {
		return Result{}, err
	}
	committed := false
	defer func() {
		if !committed {
			if err := d.abort(); err != nil {
				req.logger().Warn("cleaning up failed import", "dest", req.Dest, "err", err)
			}
		}
	}()
	src = &ctxReader{ctx: ctx, r: src}
	res, err := writeImage(ctx, req, d, src, total, t)
	if err != nil {
		return Result{}, err
	}
	if finish != nil {
		if err := finish(); err != nil {
			return Result{}, err
		}
	}
	grow := int64(0)
	if req.ExpandToCapacity {
		grow = d.capacity
	}
	if err := d.commit(grow); err != nil {
		return Result{}, err
	}
	committed = true
	res.SourceBytes = t.read()
	t.done()
	req.logger().Debug("import done", "dest", req.Dest, "format", res.Format,
		"compression", res.Compression, "virtualSize", res.VirtualSize, "streamed", res.Streamed)
	return res, nil
}

// writeImage detects compression and format and dispatches.
func writeImage(ctx context.Context, req Request, d *destination, src io.Reader, total int64, t *tracker) (Result, error) {
	if req.Raw {
		size, err := writeRaw(d, src, total, false)
		if err != nil {
			return Result{}, err
		}
		return Result{Format: FormatRaw, VirtualSize: size, Streamed: true}, nil
	}
	br := bufio.NewReaderSize(src, 1<<20)
	head, err := peek(br)
	if err != nil {
		return Result{}, err
	}
	var res Result
	if res.Compression = detectCompression(head); res.Compression != CompressionNone {
		dr, closeFn, err := decompress(ctx, res.Compression, br)
		if err != nil {
			return Result{}, err
		}
		defer closeFn()
		br = bufio.NewReaderSize(dr, 1<<20)
		if head, err = peek(br); err != nil {
			return Result{}, err
		}
		total = -1
	}
	res.Format = detectFormat(head)
	// The allowlist, before any byte is written or handed to qemu-img.
	if err := vetHead(res.Format, head); err != nil {
		return Result{}, err
	}
	switch res.Format {
	case FormatRaw, FormatISO:
		res.Streamed = true
		res.VirtualSize, err = writeRaw(d, br, total, true)
	case FormatQcow2:
		var h *qcow2Header
		if h, err = parseQcow2Header(head); err != nil {
			return Result{}, err
		}
		if err := d.setSize(int64(h.size)); err != nil {
			return Result{}, err
		}
		res.VirtualSize = int64(h.size)
		if why := h.notStreamable(); why != "" {
			req.logger().Debug("qcow2 needs qemu-img", "dest", req.Dest, "why", why)
			_, err = convertWithQemuImg(ctx, req, d, br, res.Format, t)
		} else {
			res.Streamed = true
			err = streamQcow2(ctx, req, d, br, h)
		}
	default:
		if size, ok := headerVirtualSize(res.Format, head); ok && size > d.capacity {
			return Result{}, failf(ReasonTooLarge, "image virtual size %d exceeds destination capacity %d", size, d.capacity)
		}
		res.VirtualSize, err = convertWithQemuImg(ctx, req, d, br, res.Format, t)
	}
	if err != nil {
		return Result{}, err
	}
	return res, nil
}

// peek returns the first sniffLen bytes of br, or all of a shorter stream.
func peek(br *bufio.Reader) ([]byte, error) {
	head, err := br.Peek(sniffLen)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return head, nil
}

// writeRaw streams a raw image; total is its length or -1. vhdFooter
// drops the footer of a fixed VHD (which otherwise reads as raw).
func writeRaw(d *destination, r io.Reader, total int64, vhdFooter bool) (int64, error) {
	if total >= 0 {
		if err := d.setSize(total); err != nil {
			return 0, err
		}
	}
	w := &sequentialWriter{d: d}
	n, err := io.CopyBuffer(w, r, make([]byte, 1<<20))
	if err != nil {
		return 0, err
	}
	if total >= 0 && n != total {
		return 0, failf(ReasonTruncated, "raw image ended at %d of %d bytes", n, total)
	}
	size := n
	if vs, ok := vhdFixedFooterSize(w.tail[:]); vhdFooter && ok && vs == n-512 {
		// A fixed VHD is raw data plus a footer; drop the footer.
		size = vs
		if d.block {
			if _, err := d.f.WriteAt(make([]byte, 512), size); err != nil {
				return 0, failf(ReasonDestination, "clear vhd footer: %w", err)
			}
		}
	}
	if err := d.finishSize(size); err != nil {
		return 0, err
	}
	return size, nil
}

// ctxReader fails reads once ctx is done, so that every loop reading a
// source stops when the import is canceled.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, fmt.Errorf("import canceled: %w", err)
	}
	return c.r.Read(p)
}
