package importer

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf16"
)

// The allowlist. An image is written only when it is one of these, and
// only after the checks below found nothing that points outside the image:
//
//   - raw (and iso, which is raw), including a fixed VHD;
//   - qcow2 v2/v3 without backing file, external data file or encryption;
//   - VMDK monolithicSparse or streamOptimized: a single sparse extent that
//     is the input itself, no parent;
//   - VHD fixed or dynamic (not differencing), VHDX without parent;
//   - any of these wrapped in gz, xz, zstd or bz2.
//
// Everything else with a recognised header (VMDK descriptor files, multi-
// extent VMDKs, VDI, differencing VHD/VHDX, qcow2 with references) fails
// with ReasonUnsupportedImage and a message naming what it references,
// before any of its bytes reaches the destination or qemu-img.

// vetHead checks the leading bytes of an image detected as f.
func vetHead(f Format, head []byte) error {
	switch f {
	case FormatQcow2:
		_, err := parseQcow2Header(head)
		return err
	case FormatVMDK:
		if bytes.HasPrefix(head, vmdkDescriptor) {
			return refuseDescriptorVMDK(head)
		}
		return vetVMDKSparse(bytes.NewReader(head), int64(len(head)), false)
	case FormatVHD:
		return vetVHD(head)
	case FormatVDI:
		return failf(ReasonUnsupportedImage, "vdi images are not supported (allowed: raw, qcow2, vmdk, vhd, vhdx)")
	}
	return nil
}

// vetFile checks the whole image file of size bytes before qemu-img opens
// it: the parts of the formats that lie beyond the first bytes.
func vetFile(f Format, r io.ReaderAt, size int64) error {
	switch f {
	case FormatVMDK:
		return vetVMDKSparse(r, size, true)
	case FormatVHDX:
		return vetVHDX(r, size)
	}
	return nil
}

// refuseDescriptorVMDK explains why a text VMDK descriptor is refused: its
// data lives in the files its extent lines name.
func refuseDescriptorVMDK(text []byte) error {
	d := parseVMDKDescriptor(text)
	if len(d.extents) == 0 {
		return failf(ReasonUnsupportedImage, "vmdk descriptor file (createType %q) is not a self-contained image", d.createType)
	}
	names := make([]string, 0, len(d.extents))
	for _, e := range d.extents {
		names = append(names, fmt.Sprintf("%s %q", e.kind, e.file))
	}
	return failf(ReasonUnsupportedImage, "vmdk descriptor file references extents outside the image: %s", strings.Join(names, ", "))
}

type vmdkExtent struct {
	kind string // SPARSE, FLAT, ZERO, VMFS, ...
	file string
}

type vmdkDesc struct {
	createType string
	parent     string // parentFileNameHint
	extents    []vmdkExtent
}

// parseVMDKDescriptor reads the lines of a VMDK text descriptor that say
// where its data is: createType, parentFileNameHint and extent lines
// ("RW 2048 FLAT "file" 0").
func parseVMDKDescriptor(text []byte) vmdkDesc {
	var d vmdkDesc
	if i := bytes.IndexByte(text, 0); i >= 0 {
		text = text[:i]
	}
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if k, v, ok := strings.Cut(line, "="); ok {
			v = strings.Trim(strings.TrimSpace(v), `"`)
			switch strings.TrimSpace(k) {
			case "createType":
				d.createType = v
			case "parentFileNameHint":
				d.parent = v
			}
			continue
		}
		fields := strings.Fields(line)
		if len(fields) < 3 {
			continue
		}
		switch fields[0] {
		case "RW", "RDONLY", "NOACCESS":
		default:
			continue
		}
		e := vmdkExtent{kind: fields[2]}
		if q := strings.IndexByte(line, '"'); q >= 0 {
			rest := line[q+1:]
			if end := strings.IndexByte(rest, '"'); end >= 0 {
				e.file = rest[:end]
			} else {
				e.file = rest
			}
		}
		d.extents = append(d.extents, e)
	}
	return d
}

// VMDK sparse extent header fields (little-endian), see VMware's "Virtual
// Disk Format 5.0".
const (
	vmdkDescOffsetAt = 28 // descriptor offset in sectors
	vmdkDescSizeAt   = 36 // descriptor size in sectors
	vmdkMaxDescBytes = 1 << 20
)

// vetVMDKSparse checks the descriptor embedded in a sparse VMDK (a
// monolithicSparse or streamOptimized file): one SPARSE extent, no parent.
// whole tells that r holds the whole file, so a descriptor past its end
// is an error rather than something to check later.
func vetVMDKSparse(r io.ReaderAt, size int64, whole bool) error {
	var hdr [44]byte
	if _, err := r.ReadAt(hdr[:], 0); err != nil {
		if whole {
			return failf(ReasonTruncated, "vmdk header truncated")
		}
		return nil
	}
	le := binary.LittleEndian
	if !bytes.Equal(hdr[:4], magicVMDK) {
		return failf(ReasonInvalidImage, "not a sparse vmdk")
	}
	off, n := le.Uint64(hdr[vmdkDescOffsetAt:]), le.Uint64(hdr[vmdkDescSizeAt:])
	if off == 0 && n == 0 {
		// No embedded descriptor: a lone extent, which is the input.
		return nil
	}
	if off > uint64(size)/512 || n > vmdkMaxDescBytes/512 {
		if !whole && off <= 1<<40 && n <= vmdkMaxDescBytes/512 {
			return nil // beyond what we have yet; checked on the whole file
		}
		return failf(ReasonInvalidImage, "vmdk embedded descriptor at sector %d (%d sectors) lies outside the image", off, n)
	}
	start, length := int64(off)*512, int64(n)*512
	if start+length > size {
		if !whole {
			return nil
		}
		return failf(ReasonTruncated, "vmdk embedded descriptor ends past the image")
	}
	text := make([]byte, length)
	if _, err := r.ReadAt(text, start); err != nil && err != io.EOF {
		return failf(ReasonInvalidImage, "read vmdk descriptor: %w", err)
	}
	d := parseVMDKDescriptor(text)
	switch d.createType {
	case "monolithicSparse", "streamOptimized", "":
	default:
		return failf(ReasonUnsupportedImage, "vmdk createType %q is not a single-file image", d.createType)
	}
	if d.parent != "" {
		return failf(ReasonUnsupportedImage, "vmdk image has a parent %q", d.parent)
	}
	if len(d.extents) > 1 {
		names := make([]string, 0, len(d.extents))
		for _, e := range d.extents {
			names = append(names, fmt.Sprintf("%s %q", e.kind, e.file))
		}
		return failf(ReasonUnsupportedImage, "vmdk image has %d extents (%s); only one, the image itself, is allowed", len(d.extents), strings.Join(names, ", "))
	}
	if len(d.extents) == 1 && d.extents[0].kind != "SPARSE" {
		return failf(ReasonUnsupportedImage, "vmdk extent %s %q is not the image itself", d.extents[0].kind, d.extents[0].file)
	}
	return nil
}

// VHD disk types (the footer's field at 60).
const (
	vhdTypeFixed        = 2
	vhdTypeDynamic      = 3
	vhdTypeDifferencing = 4
)

// vetVHD checks an image that starts with a VHD footer copy (a dynamic or
// differencing VHD).
func vetVHD(head []byte) error {
	if len(head) < 64 {
		return failf(ReasonTruncated, "vhd footer truncated")
	}
	be := binary.BigEndian
	switch t := be.Uint32(head[60:]); t {
	case vhdTypeFixed, vhdTypeDynamic:
		return nil
	case vhdTypeDifferencing:
		return failf(ReasonUnsupportedImage, "vhd differencing image with parent %q", vhdParentName(head))
	default:
		return failf(ReasonInvalidImage, "vhd disk type %d", t)
	}
}

// vhdParentName reads the parent's name from a differencing VHD's dynamic
// header, if it is in head.
func vhdParentName(head []byte) string {
	dyn := binary.BigEndian.Uint64(head[16:])
	const nameAt, nameLen = 64, 512
	if dyn > uint64(len(head)) || uint64(len(head))-dyn < nameAt+nameLen {
		return "?"
	}
	raw := head[dyn+nameAt : dyn+nameAt+nameLen]
	u := make([]uint16, 0, nameLen/2)
	for i := 0; i+1 < len(raw); i += 2 {
		c := binary.BigEndian.Uint16(raw[i:])
		if c == 0 {
			break
		}
		u = append(u, c)
	}
	return string(utf16.Decode(u))
}

// VHDX layout (MS-VHDX): the region table at 192 KiB lists the metadata
// region, whose table lists the file parameters (with the HasParent bit)
// and, for differencing images, the parent locator.
const (
	vhdxRegionTableAt = 192 << 10
	vhdxMaxEntries    = 2047
)

var (
	vhdxRegionSig    = []byte("regi")
	vhdxMetadataSig  = []byte("metadata")
	vhdxMetadataGUID = guidBytes("8B7CA206-4790-4B9A-B8FE-575F050F886E")
	vhdxFileParams   = guidBytes("CAA16737-FA36-4D43-B3B6-33F0AA44E76B")
	vhdxParentLoc    = guidBytes("A8D35F2D-B30B-454D-ABF7-D3D84834AB0C")
)

// vetVHDX refuses a VHDX whose parameters say it has a parent (a
// differencing image) or that carries a parent locator.
func vetVHDX(r io.ReaderAt, size int64) error {
	le := binary.LittleEndian
	rt := make([]byte, 64<<10)
	if _, err := r.ReadAt(rt, vhdxRegionTableAt); err != nil {
		return failf(ReasonTruncated, "vhdx region table: %w", err)
	}
	if !bytes.Equal(rt[:4], vhdxRegionSig) {
		return failf(ReasonInvalidImage, "vhdx region table signature missing")
	}
	count := le.Uint32(rt[8:])
	if count > vhdxMaxEntries {
		return failf(ReasonInvalidImage, "vhdx region table has %d entries", count)
	}
	var metaOff, metaLen int64 = -1, 0
	for i := range int(count) {
		e := rt[16+32*i : 16+32*(i+1)]
		if bytes.Equal(e[:16], vhdxMetadataGUID) {
			metaOff, metaLen = int64(le.Uint64(e[16:])), int64(le.Uint32(e[24:]))
		}
	}
	if metaOff < 0 || metaLen < 32 || metaOff > size || metaLen > size-metaOff {
		return failf(ReasonInvalidImage, "vhdx metadata region missing or outside the image")
	}
	mt := make([]byte, min(metaLen, 64<<10))
	if _, err := r.ReadAt(mt, metaOff); err != nil {
		return failf(ReasonTruncated, "vhdx metadata table: %w", err)
	}
	if !bytes.Equal(mt[:8], vhdxMetadataSig) {
		return failf(ReasonInvalidImage, "vhdx metadata table signature missing")
	}
	n := int(le.Uint16(mt[10:]))
	for i := range n {
		at := 32 + 32*i
		if at+32 > len(mt) {
			return failf(ReasonInvalidImage, "vhdx metadata table has %d entries", n)
		}
		e := mt[at : at+32]
		switch {
		case bytes.Equal(e[:16], vhdxParentLoc):
			return failf(ReasonUnsupportedImage, "vhdx differencing image (has a parent locator)")
		case bytes.Equal(e[:16], vhdxFileParams):
			off, ln := int64(le.Uint32(e[16:])), int64(le.Uint32(e[20:]))
			if ln < 8 || off > metaLen-8 {
				return failf(ReasonInvalidImage, "vhdx file parameters outside the metadata region")
			}
			var fp [8]byte
			if _, err := r.ReadAt(fp[:], metaOff+off); err != nil {
				return failf(ReasonTruncated, "vhdx file parameters: %w", err)
			}
			if le.Uint32(fp[4:])&2 != 0 {
				return failf(ReasonUnsupportedImage, "vhdx differencing image (HasParent)")
			}
		}
	}
	return nil
}

// guidBytes is the on-disk (mixed-endian) form of a GUID string.
func guidBytes(s string) []byte {
	h := strings.ReplaceAll(s, "-", "")
	b := make([]byte, 16)
	for i := range b {
		v, _ := strconv.ParseUint(h[2*i:2*i+2], 16, 8)
		b[i] = byte(v)
	}
	// Data1 (4 bytes), Data2 and Data3 (2 bytes each) are little-endian.
	b[0], b[1], b[2], b[3] = b[3], b[2], b[1], b[0]
	b[4], b[5] = b[5], b[4]
	b[6], b[7] = b[7], b[6]
	return b
}
