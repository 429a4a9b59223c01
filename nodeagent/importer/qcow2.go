package importer

import (
	"bytes"
	"compress/flate"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"

	"github.com/klauspost/compress/zstd"
)

// qcow2 header fields used here (all big-endian), see qemu's
// docs/interop/qcow2.txt.
type qcow2Header struct {
	version               uint32
	backingOffset         uint64
	clusterBits           uint32
	size                  uint64
	cryptMethod           uint32
	l1Size                uint32
	l1Offset              uint64
	refcountTableOffset   uint64
	refcountTableClusters uint32
	incompatible          uint64
	compressionType       uint8
}

const (
	qcow2IncompatDirty       = 1 << 0
	qcow2IncompatCorrupt     = 1 << 1
	qcow2IncompatDataFile    = 1 << 2
	qcow2IncompatCompression = 1 << 3
	qcow2IncompatExtL2       = 1 << 4
	qcow2IncompatKnown       = 1<<5 - 1

	qcow2OffsetMask     = 0x00fffffffffffe00 // host offset bits of L1/L2 entries
	qcow2CompressedFlag = 1 << 62
	qcow2ZeroFlag       = 1 << 0
)

func parseQcow2Header(b []byte) (*qcow2Header, error) {
	if len(b) < 72 {
		return nil, failf(ReasonTruncated, "qcow2 header truncated at %d bytes", len(b))
	}
	be := binary.BigEndian
	h := &qcow2Header{
		version:               be.Uint32(b[4:]),
		backingOffset:         be.Uint64(b[8:]),
		clusterBits:           be.Uint32(b[20:]),
		size:                  be.Uint64(b[24:]),
		cryptMethod:           be.Uint32(b[32:]),
		l1Size:                be.Uint32(b[36:]),
		l1Offset:              be.Uint64(b[40:]),
		refcountTableOffset:   be.Uint64(b[48:]),
		refcountTableClusters: be.Uint32(b[56:]),
	}
	switch h.version {
	case 2:
	case 3:
		if len(b) < 104 {
			return nil, failf(ReasonTruncated, "qcow2 v3 header truncated at %d bytes", len(b))
		}
		h.incompatible = be.Uint64(b[72:])
		if hl := be.Uint32(b[100:]); hl > 104 && len(b) > 104 {
			h.compressionType = b[104]
		}
	default:
		return nil, failf(ReasonUnsupportedImage, "qcow2 version %d", h.version)
	}
	if h.clusterBits < 9 || h.clusterBits > 21 {
		return nil, failf(ReasonInvalidImage, "qcow2 cluster bits %d out of range", h.clusterBits)
	}
	cs := uint64(1) << h.clusterBits
	switch {
	case h.incompatible&qcow2IncompatCorrupt != 0:
		return nil, failf(ReasonInvalidImage, "qcow2 image is marked corrupt")
	case h.incompatible&^qcow2IncompatKnown != 0:
		return nil, failf(ReasonUnsupportedImage, "qcow2 incompatible features %#x", h.incompatible)
	case h.backingOffset != 0:
		return nil, failf(ReasonUnsupportedImage, "qcow2 image has a backing file %q", qcow2BackingName(b))
	case h.incompatible&qcow2IncompatDataFile != 0:
		name, _ := qcow2Extension(b, h, qcow2ExtDataFile)
		return nil, failf(ReasonUnsupportedImage, "qcow2 image with an external data file %q", name)
	case h.cryptMethod != 0:
		return nil, failf(ReasonUnsupportedImage, "qcow2 image is encrypted")
	case h.l1Offset%cs != 0:
		return nil, failf(ReasonInvalidImage, "qcow2 L1 table offset %d not cluster aligned", h.l1Offset)
	case uint64(h.l1Size)*8 > qcow2MaxL1Bytes:
		return nil, failf(ReasonInvalidImage, "qcow2 L1 table of %d entries is too large", h.l1Size)
	}
	if err := qcow2VetExtensions(b, h); err != nil {
		return nil, err
	}
	l2Entries := cs / 8
	if h.incompatible&qcow2IncompatExtL2 != 0 {
		l2Entries = cs / 16
	}
	if need := (h.size + cs*l2Entries - 1) / (cs * l2Entries); need > uint64(h.l1Size) {
		return nil, failf(ReasonInvalidImage, "qcow2 L1 table of %d entries cannot map %d bytes", h.l1Size, h.size)
	}
	return h, nil
}

// qcow2 header extension types (docs/interop/qcow2.txt).
const (
	qcow2ExtEnd      = 0
	qcow2ExtCrypto   = 0x0537be77
	qcow2ExtDataFile = 0x44415441
)

// qcow2BackingName is the backing file name the header points at, or "?"
// when it lies beyond b.
func qcow2BackingName(b []byte) string {
	be := binary.BigEndian
	off, n := be.Uint64(b[8:]), uint64(be.Uint32(b[16:]))
	if n > 1023 || off > uint64(len(b)) || uint64(len(b))-off < n {
		return "?"
	}
	return string(b[off : off+n])
}

// qcow2Extensions walks the header extensions, calling f with each type
// and its data. The walk must end (with the end marker) within b and the
// first cluster; an image whose extensions do not is refused.
func qcow2Extensions(b []byte, h *qcow2Header, f func(typ uint32, data []byte)) error {
	be := binary.BigEndian
	at := uint64(72)
	if h.version >= 3 {
		at = uint64(be.Uint32(b[100:]))
		if at < 104 {
			return failf(ReasonInvalidImage, "qcow2 header length %d", at)
		}
	}
	limit := min(uint64(len(b)), uint64(1)<<h.clusterBits)
	for {
		if at+8 > limit {
			return failf(ReasonUnsupportedImage, "qcow2 header extensions run past the first %d bytes", limit)
		}
		typ, n := be.Uint32(b[at:]), uint64(be.Uint32(b[at+4:]))
		if typ == qcow2ExtEnd {
			return nil
		}
		if n > limit-at-8 {
			return failf(ReasonUnsupportedImage, "qcow2 header extension %#x runs past the first %d bytes", typ, limit)
		}
		f(typ, b[at+8:at+8+n])
		at += 8 + (n+7)&^7
	}
}

// qcow2Extension returns the data of the first extension of type typ.
func qcow2Extension(b []byte, h *qcow2Header, typ uint32) (string, bool) {
	var out string
	found := false
	_ = qcow2Extensions(b, h, func(t uint32, data []byte) {
		if t == typ && !found {
			out, found = string(data), true
		}
	})
	return out, found
}

// qcow2VetExtensions refuses the header extensions that reference
// something outside the image (an external data file) or make it
// unreadable without a key (encryption).
func qcow2VetExtensions(b []byte, h *qcow2Header) error {
	var refused error
	err := qcow2Extensions(b, h, func(typ uint32, data []byte) {
		switch {
		case refused != nil:
		case typ == qcow2ExtDataFile:
			refused = failf(ReasonUnsupportedImage, "qcow2 image with an external data file %q", string(data))
		case typ == qcow2ExtCrypto:
			refused = failf(ReasonUnsupportedImage, "qcow2 image is encrypted")
		}
	})
	if refused != nil {
		return refused
	}
	return err
}

// notStreamable says why the Go converter cannot take this image, or "".
func (h *qcow2Header) notStreamable() string {
	if h.incompatible&qcow2IncompatExtL2 != 0 {
		return "extended L2 entries"
	}
	if h.compressionType > 1 {
		return "unknown compression type"
	}
	return ""
}

// qcow2Stream converts a qcow2 image to raw while reading it once, front to
// back. The L1 table says where the L2 tables are, the L2 tables say where
// each guest cluster's data is; as the stream passes each host cluster it
// is parsed (L1/L2), written to its guest offset (data), fed to the
// compressed clusters it holds, or skipped (header, refcounts). A cluster
// that nothing claims yet while some L2 table is still unread may be data
// placed before its table: it is parked in a sparse spill file at its host
// offset and fetched from there when a table claims it.
type qcow2Stream struct {
	h       *qcow2Header
	d       *destination
	cs      int64
	size    int64
	pos     int64 // host offset of the cluster being processed
	workDir string
	name    string

	l1     []byte
	l1Got  int64
	l1Done bool

	rt        []byte // refcount table, to recognise refcount blocks
	rtGot     int64
	refBlocks offsetSet

	// Clusters announced ahead of pos, by host cluster index: L2 tables
	// (value: the L1 index that points at them) and data clusters (value:
	// the guest cluster index). See qcow2budget.go for the limits.
	l2Pending clusterQueue
	data      clusterQueue
	comp      map[int64][]*compressedRun // host cluster -> compressed runs touching it
	compRuns  int                        // compressed runs not yet complete
	popped    []uint32

	spill   *os.File
	spilled clusterSet // host clusters parked whole

	out     []byte
	inflate io.ReadCloser
	zstd    *zstd.Decoder
}

// compressedRun is one compressed guest cluster: bytes [start, end) of the
// file, end possibly overestimated by up to a sector (as the format does).
type compressedRun struct {
	guest      int64
	start, end int64
	buf        []byte
}

func streamQcow2(ctx context.Context, req Request, d *destination, r io.Reader, h *qcow2Header) error {
	s := &qcow2Stream{
		h: h, d: d, cs: 1 << h.clusterBits, size: int64(h.size),
		workDir: req.workDir(), name: filepath.Base(req.Dest),
		l1:   make([]byte, int64(h.l1Size)*8),
		rt:   make([]byte, refcountTableBytes(h)),
		comp: map[int64][]*compressedRun{},
	}
	// Cluster indexes are kept in 32 bits.
	if (s.size+s.size/8+64<<20)>>h.clusterBits >= 1<<32 {
		return failf(ReasonUnsupportedImage, "qcow2 image of %d bytes in %d-byte clusters has too many clusters to stream", s.size, s.cs)
	}
	s.out = make([]byte, s.cs)
	defer s.close()
	if h.l1Size == 0 {
		s.l1Done = true
	}
	// An honest image is its data plus a little metadata; anything much
	// longer is refused rather than read forever.
	limit := s.size + s.size/8 + int64(len(s.l1)) + 64<<20
	buf := make([]byte, max(s.cs, 1<<20))
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, err := io.ReadFull(r, buf)
		for i := 0; i < n; i += int(s.cs) {
			c := buf[i:min(n, i+int(s.cs))]
			if perr := s.cluster(c); perr != nil {
				return perr
			}
			s.pos += int64(len(c))
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			break
		}
		if err != nil {
			return err
		}
		if s.pos > limit {
			return failf(ReasonTooLarge, "qcow2 stream exceeds %d bytes for a %d-byte image", limit, s.size)
		}
	}
	return s.finish()
}

// refcountTableBytes is the size of the refcount table to track, or 0
// when it is too large to keep (its blocks are then simply parked).
func refcountTableBytes(h *qcow2Header) int64 {
	n := int64(h.refcountTableClusters) << h.clusterBits
	if n > qcow2MaxRefcountTableBytes {
		return 0
	}
	return n
}

func (s *qcow2Stream) close() {
	if s.spill != nil {
		s.spill.Close()
		os.Remove(s.spill.Name())
	}
	if s.zstd != nil {
		s.zstd.Close()
	}
}

func (s *qcow2Stream) mappingComplete() bool { return s.l1Done && len(s.l2Pending) == 0 }

// idx is the cluster index of a host offset.
func (s *qcow2Stream) idx(off int64) uint32 { return uint32(off >> s.h.clusterBits) }

// track checks the budget of clusters remembered ahead or parked.
func (s *qcow2Stream) track() error {
	if n := len(s.l2Pending) + len(s.data) + s.spilled.n; n > qcow2MaxTracked {
		return failf(ReasonUnsupportedImage, "qcow2 image maps more than %d clusters ahead of their data: its layout needs too much memory to stream", qcow2MaxTracked)
	}
	return nil
}

// cluster handles the host cluster c at s.pos.
func (s *qcow2Stream) cluster(c []byte) error {
	pos, end := s.pos, s.pos+int64(len(c))
	meta := pos == 0 // the header
	if l1Off := int64(s.h.l1Offset); !s.l1Done && l1Off < end && l1Off+int64(len(s.l1)) > pos {
		from, to := max(l1Off, pos), min(l1Off+int64(len(s.l1)), end)
		copy(s.l1[from-l1Off:], c[from-pos:to-pos])
		s.l1Got += to - from
		meta = true
		if s.l1Got == int64(len(s.l1)) {
			s.l1Done = true
			if err := s.parseL1(); err != nil {
				return err
			}
		}
	}
	if rt := int64(s.h.refcountTableOffset); rt <= pos && pos < rt+int64(len(s.rt)) {
		copy(s.rt[pos-rt:], c)
		if s.rtGot += int64(len(c)); s.rtGot >= int64(len(s.rt)) {
			for i := 0; i+8 <= len(s.rt); i += 8 {
				if off := int64(binary.BigEndian.Uint64(s.rt[i:]) & qcow2OffsetMask); off != 0 {
					s.refBlocks = append(s.refBlocks, off)
				}
			}
			slices.Sort(s.refBlocks)
		}
		meta = true
	}
	if s.refBlocks.has(pos) {
		meta = true
	}
	if s.popped = s.l2Pending.popAt(s.idx(pos), s.popped[:0]); len(s.popped) > 0 {
		if len(s.popped) > 1 {
			return failf(ReasonUnsupportedImage, "qcow2 L2 table at %d is shared", pos)
		}
		if err := s.parseL2(c, int64(s.popped[0])*s.cs*(s.cs/8)); err != nil {
			return err
		}
		meta = true
	}
	if s.popped = s.data.popAt(s.idx(pos), s.popped[:0]); len(s.popped) > 0 {
		if meta {
			return failf(ReasonInvalidImage, "qcow2 data cluster at %d overlaps metadata", pos)
		}
		for _, g := range s.popped {
			if err := s.writeGuest(c, int64(g)*s.cs); err != nil {
				return err
			}
		}
		return nil
	}
	runs := s.comp[pos]
	delete(s.comp, pos)
	for _, run := range runs {
		from, to := max(run.start, pos), min(run.end, end)
		run.buf = append(run.buf, c[from-pos:to-pos]...)
		if run.end <= end {
			s.compRuns--
			if err := s.decompress(run); err != nil {
				return err
			}
		}
	}
	if meta || s.mappingComplete() {
		return nil
	}
	return s.park(c, runs)
}

// park spills the parts of c that no known compressed run surely owns.
// A run surely owns its bytes except the last sector, which may hold the
// start of the next run.
func (s *qcow2Stream) park(c []byte, runs []*compressedRun) error {
	pos := s.pos
	type span struct{ from, to int64 }
	var owned []span
	for _, r := range runs {
		from, to := max(r.start, pos), min(r.end-512, pos+int64(len(c)))
		if to > from {
			owned = append(owned, span{from - pos, to - pos})
		}
	}
	if len(owned) == 0 {
		s.spilled.add(s.idx(pos))
		if err := s.track(); err != nil {
			return err
		}
		return s.spillAt(c, pos)
	}
	sort.Slice(owned, func(i, j int) bool { return owned[i].from < owned[j].from })
	var at int64
	for _, o := range owned {
		if o.from > at {
			if err := s.spillAt(c[at:o.from], pos+at); err != nil {
				return err
			}
		}
		at = max(at, o.to)
	}
	if at < int64(len(c)) {
		return s.spillAt(c[at:], pos+at)
	}
	return nil
}

func (s *qcow2Stream) spillAt(b []byte, off int64) error {
	if isZero(b) {
		return nil
	}
	if s.spill == nil {
		if s.workDir == "" {
			return failf(ReasonScratchRequired, "qcow2 image places data before its tables and no work directory was given")
		}
		f, err := os.CreateTemp(s.workDir, "."+s.name+".spill-*")
		if err != nil {
			return failf(ReasonDestination, "create spill file: %w", err)
		}
		s.spill = f
	}
	if _, err := s.spill.WriteAt(b, off); err != nil {
		return failf(ReasonDestination, "write spill file: %w", err)
	}
	return nil
}

// unspill reads back n bytes parked at off; never-parked bytes read zero.
func (s *qcow2Stream) unspill(off int64, n int64) ([]byte, error) {
	b := make([]byte, n)
	if s.spill == nil {
		return b, nil
	}
	if _, err := s.spill.ReadAt(b, off); err != nil && !errors.Is(err, io.EOF) {
		return nil, failf(ReasonDestination, "read spill file: %w", err)
	}
	return b, nil
}

func (s *qcow2Stream) parseL1() error {
	perL2 := s.cs * (s.cs / 8)
	for i := 0; i < len(s.l1)/8; i++ {
		off := int64(binary.BigEndian.Uint64(s.l1[i*8:]) & qcow2OffsetMask)
		guest := int64(i) * perL2
		if off == 0 || guest >= s.size {
			continue
		}
		if off%s.cs != 0 {
			return failf(ReasonInvalidImage, "qcow2 L2 table offset %d not cluster aligned", off)
		}
		switch {
		case off > s.pos:
			s.l2Pending.push(s.idx(off), uint32(i))
			if err := s.track(); err != nil {
				return err
			}
		case s.spilled.has(s.idx(off)):
			b, err := s.unspill(off, s.cs)
			if err != nil {
				return err
			}
			if err := s.parseL2(b, guest); err != nil {
				return err
			}
		default:
			return failf(ReasonInvalidImage, "qcow2 L2 table at %d overlaps other metadata", off)
		}
	}
	return nil
}

func (s *qcow2Stream) parseL2(table []byte, guest int64) error {
	if int64(len(table)) < s.cs {
		table = append(append([]byte(nil), table...), make([]byte, s.cs-int64(len(table)))...)
	}
	csizeShift := 62 - (s.h.clusterBits - 8)
	for j := int64(0); j < s.cs/8; j++ {
		g := guest + j*s.cs
		if g >= s.size {
			break
		}
		e := binary.BigEndian.Uint64(table[j*8:])
		if e&qcow2CompressedFlag != 0 {
			start := int64(e & (1<<csizeShift - 1))
			sectors := int64((e>>csizeShift)&(1<<(62-csizeShift)-1)) + 1
			if err := s.addCompressed(g, start, start+sectors*512-start%512); err != nil {
				return err
			}
			continue
		}
		host := int64(e & qcow2OffsetMask)
		if e&qcow2ZeroFlag != 0 || host == 0 {
			continue // reads as zero: the destination already does
		}
		if host%s.cs != 0 {
			return failf(ReasonInvalidImage, "qcow2 data cluster offset %d not cluster aligned", host)
		}
		if err := s.addData(g, host); err != nil {
			return err
		}
	}
	return nil
}

func (s *qcow2Stream) addData(guest, host int64) error {
	switch {
	case host > s.pos:
		s.data.push(s.idx(host), uint32(guest/s.cs))
		return s.track()
	case s.spilled.has(s.idx(host)):
		b, err := s.unspill(host, s.cs)
		if err != nil {
			return err
		}
		return s.writeGuest(b, guest)
	default:
		return failf(ReasonInvalidImage, "qcow2 data cluster at %d overlaps metadata or is shared", host)
	}
}

func (s *qcow2Stream) addCompressed(guest, start, end int64) error {
	run := &compressedRun{guest: guest, start: start, end: end}
	if start < s.pos {
		b, err := s.unspill(start, min(end, s.pos)-start)
		if err != nil {
			return err
		}
		run.buf = b
		if end <= s.pos {
			return s.decompress(run)
		}
	}
	if s.compRuns++; s.compRuns > qcow2MaxCompressedRuns {
		return failf(ReasonUnsupportedImage, "qcow2 image maps more than %d compressed clusters ahead of their data: its layout needs too much memory to stream", qcow2MaxCompressedRuns)
	}
	for k := max(start, s.pos) / s.cs * s.cs; k < end; k += s.cs {
		s.comp[k] = append(s.comp[k], run)
	}
	return nil
}

func (s *qcow2Stream) decompress(run *compressedRun) error {
	var dec io.Reader
	switch s.h.compressionType {
	case 0:
		if s.inflate == nil {
			s.inflate = flate.NewReader(bytes.NewReader(run.buf))
		} else if err := s.inflate.(flate.Resetter).Reset(bytes.NewReader(run.buf), nil); err != nil {
			return failf(ReasonInvalidImage, "qcow2 compressed cluster: %w", err)
		}
		dec = s.inflate
	default:
		if s.zstd == nil {
			// A compressed cluster decodes to one cluster: a frame asking
			// for a larger window is not one qemu wrote.
			z, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
				zstd.WithDecoderMaxWindow(uint64(max(s.cs, 1<<20))), zstd.WithDecoderMaxMemory(uint64(4*max(s.cs, 1<<20))))
			if err != nil {
				return err
			}
			s.zstd = z
		}
		if err := s.zstd.Reset(bytes.NewReader(run.buf)); err != nil {
			return failf(ReasonInvalidImage, "qcow2 compressed cluster: %w", err)
		}
		dec = s.zstd
	}
	if _, err := io.ReadFull(dec, s.out); err != nil {
		return failf(ReasonInvalidImage, "qcow2 compressed cluster for guest offset %d: %w", run.guest, err)
	}
	return s.writeGuest(s.out, run.guest)
}

// writeGuest writes one guest cluster (clipped at the virtual size).
func (s *qcow2Stream) writeGuest(c []byte, guest int64) error {
	n := min(int64(len(c)), s.size-guest)
	_, err := s.d.WriteAt(c[:n], guest)
	return err
}

// finish completes what the end of the file explains and fails on what is
// still missing.
func (s *qcow2Stream) finish() error {
	switch {
	case !s.l1Done:
		return failf(ReasonTruncated, "qcow2 image ended before its L1 table")
	case len(s.l2Pending) > 0:
		return failf(ReasonTruncated, "qcow2 image ended before %d of its L2 tables", len(s.l2Pending))
	case len(s.data) > 0:
		return failf(ReasonTruncated, "qcow2 image ended before %d of its data clusters", len(s.data))
	}
	// A compressed run's end is an estimate that may pass the end of file.
	done := map[*compressedRun]bool{}
	for _, runs := range s.comp {
		for _, r := range runs {
			if done[r] {
				continue
			}
			done[r] = true
			if r.start+int64(len(r.buf)) < min(r.end, s.pos) || r.start >= s.pos {
				return failf(ReasonTruncated, "qcow2 image ended inside a compressed cluster")
			}
			if err := s.decompress(r); err != nil {
				return err
			}
		}
	}
	return nil
}
