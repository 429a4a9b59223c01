package importer

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// Fuzz targets for everything that reads untrusted image bytes in this
// process: format and compression sniffing, the allowlist checks (qcow2
// header and extensions, VMDK descriptors, VHD footers, VHDX region and
// metadata tables), the streaming qcow2 converter, the Go decompressors
// and the vetting of qemu-img's JSON. Seed corpora live in
// testdata/fuzz/<Name>/ (made from real qemu-img images); `go test` runs
// the seeds, `go test -fuzz=<Name>` explores.

// FuzzSniff: detection and the allowlist never panic, and whatever they
// accept references nothing outside the image.
func FuzzSniff(f *testing.F) {
	f.Add([]byte("# Disk DescriptorFile\nRW 4 FLAT \"/etc/passwd\" 0\n"))
	f.Add(append([]byte("QFI\xfb\x00\x00\x00\x03"), make([]byte, 120)...))
	f.Add([]byte("conectix"))
	f.Add([]byte("BZh91AY&SY"))
	f.Fuzz(func(t *testing.T, data []byte) {
		_ = detectCompression(data)
		format := detectFormat(data)
		err := vetHead(format, data)
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("vetHead error %T is not *Error: %v", err, err)
			}
			return
		}
		if format == FormatVMDK && bytes.HasPrefix(data, vmdkDescriptor) {
			t.Fatalf("a vmdk descriptor passed the allowlist")
		}
		if format == FormatVDI {
			t.Fatalf("vdi passed the allowlist")
		}
		if format == FormatQcow2 {
			h, err := parseQcow2Header(data)
			if err != nil {
				t.Fatalf("vetHead accepted a qcow2 header parseQcow2Header refuses: %v", err)
			}
			assertSelfContainedQcow2(t, data, h)
		}
		for _, f := range []Format{FormatQcow2, FormatVMDK, FormatVDI, FormatVHD} {
			headerVirtualSize(f, data)
		}
		if len(data) >= 512 {
			vhdFixedFooterSize(data[len(data)-512:])
		}
	})
}

func assertSelfContainedQcow2(t *testing.T, data []byte, h *qcow2Header) {
	t.Helper()
	if h.backingOffset != 0 || h.cryptMethod != 0 || h.incompatible&qcow2IncompatDataFile != 0 {
		t.Fatalf("accepted qcow2 header with a reference: %+v", h)
	}
	if _, ok := qcow2Extension(data, h, qcow2ExtDataFile); ok {
		t.Fatalf("accepted qcow2 header with a data-file extension")
	}
	if _, ok := qcow2Extension(data, h, qcow2ExtCrypto); ok {
		t.Fatalf("accepted qcow2 header with an encryption extension")
	}
	if uint64(h.l1Size)*8 > qcow2MaxL1Bytes {
		t.Fatalf("accepted an L1 table of %d entries", h.l1Size)
	}
}

// FuzzQcow2Stream runs the streaming qcow2 converter on arbitrary
// streams (virtual size capped at 1 MiB) into a scratch destination: no
// panic, errors are *Error, nothing is written past the virtual size.
// The destination is aborted, not committed (no fsync per input).
func FuzzQcow2Stream(f *testing.F) {
	dir := f.TempDir()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		if d, err := os.MkdirTemp("/dev/shm", "nodevirt-fuzz-"); err == nil {
			dir = d
			f.Cleanup(func() { os.RemoveAll(d) })
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if detectCompression(data) != CompressionNone || detectFormat(data) != FormatQcow2 {
			return
		}
		h, err := parseQcow2Header(data)
		if err != nil || h.notStreamable() != "" || h.size > 1<<20 {
			return
		}
		d, err := openDestination(filepath.Join(dir, "disk.img"), false, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		defer d.abort()
		if err := d.setSize(int64(h.size)); err != nil {
			t.Fatal(err)
		}
		err = streamQcow2(context.Background(), Request{Dest: filepath.Join(dir, "disk.img")}, d, bytes.NewReader(data), h)
		if err != nil {
			var ie *Error
			if !errors.As(err, &ie) {
				t.Fatalf("error %T is not *Error: %v", err, err)
			}
			return
		}
		if d.written > int64(h.size) {
			t.Fatalf("wrote up to %d in a %d-byte image", d.written, h.size)
		}
	})
}

// FuzzVMDK parses text descriptors and sparse headers with embedded
// descriptors: a descriptor is always refused, and an accepted sparse
// VMDK has at most one extent, SPARSE, and no parent.
func FuzzVMDK(f *testing.F) {
	f.Add([]byte("# Disk DescriptorFile\nversion=1\ncreateType=\"twoGbMaxExtentSparse\"\nRW 4192256 SPARSE \"a-s001.vmdk\"\nRW 4192256 SPARSE \"a-s002.vmdk\"\n"))
	f.Add([]byte("# Disk DescriptorFile\nparentFileNameHint=\"/etc/shadow\"\nRW 8 VMFS \"x\nRDONLY 0 ZERO\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if bytes.HasPrefix(data, vmdkDescriptor) {
			if err := vetHead(FormatVMDK, data); ReasonOf(err) != ReasonUnsupportedImage {
				t.Fatalf("descriptor: %v, want %s", err, ReasonUnsupportedImage)
			}
			return
		}
		parseVMDKDescriptor(data)
		if !bytes.HasPrefix(data, magicVMDK) {
			return
		}
		err := vetVMDKSparse(bytes.NewReader(data), int64(len(data)), true)
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error %T is not *Error: %v", err, err)
			}
			return
		}
		le := binary.LittleEndian
		off, n := le.Uint64(data[vmdkDescOffsetAt:]), le.Uint64(data[vmdkDescSizeAt:])
		if off == 0 && n == 0 {
			return
		}
		desc := parseVMDKDescriptor(data[off*512 : off*512+n*512])
		if desc.parent != "" || len(desc.extents) > 1 || (len(desc.extents) == 1 && desc.extents[0].kind != "SPARSE") {
			t.Fatalf("accepted embedded descriptor %+v", desc)
		}
	})
}

// vhdxFile lays fuzz input out as a VHDX would be read: the first part
// is the region table at 192 KiB, the rest sits at 1 MiB (where the seeds
// put the metadata region); everything else reads zero.
type vhdxFile struct{ rt, meta []byte }

const vhdxFuzzMetaAt = 1 << 20

func (v vhdxFile) size() int64 { return vhdxFuzzMetaAt + int64(len(v.meta)) }

func (v vhdxFile) ReadAt(p []byte, off int64) (int, error) {
	clear(p)
	for _, part := range []struct {
		at int64
		b  []byte
	}{{vhdxRegionTableAt, v.rt}, {vhdxFuzzMetaAt, v.meta}} {
		if off < part.at+int64(len(part.b)) && off+int64(len(p)) > part.at {
			from := max(off, part.at)
			copy(p[from-off:], part.b[from-part.at:])
		}
	}
	if end := v.size(); off+int64(len(p)) > end {
		n := max(0, int(end-off))
		return n, io.EOF
	}
	return len(p), nil
}

// FuzzVHDX: region and metadata tables never panic the parser, and an
// accepted image has neither a parent locator nor the HasParent bit.
func FuzzVHDX(f *testing.F) {
	f.Fuzz(func(t *testing.T, rt, meta []byte) {
		v := vhdxFile{rt: rt, meta: meta}
		err := vetVHDX(v, v.size())
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error %T is not *Error: %v", err, err)
			}
			return
		}
		if len(meta) >= 32 {
			n := int(binary.LittleEndian.Uint16(meta[10:]))
			for i := 0; i < n && 32+32*i+32 <= len(meta); i++ {
				if bytes.Equal(meta[32+32*i:32+32*i+16], vhdxParentLoc) {
					// Only a parent locator in the region actually read counts.
					if regionPointsAtMeta(rt) {
						t.Fatalf("accepted a vhdx with a parent locator")
					}
				}
			}
		}
	})
}

func regionPointsAtMeta(rt []byte) bool {
	if len(rt) < 16 || !bytes.Equal(rt[:4], vhdxRegionSig) {
		return false
	}
	le := binary.LittleEndian
	for i := 0; i < int(le.Uint32(rt[8:])) && 16+32*i+32 <= len(rt); i++ {
		e := rt[16+32*i:]
		if bytes.Equal(e[:16], vhdxMetadataGUID) && le.Uint64(e[16:]) == vhdxFuzzMetaAt {
			return true
		}
	}
	return false
}

// FuzzDecompress runs the in-process decoders (gz, zstd, bz2) on
// arbitrary input, reading at most 4 MiB: no panic, errors are *Error.
func FuzzDecompress(f *testing.F) {
	f.Add([]byte("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00"))
	f.Add([]byte("\x28\xb5\x2f\xfd\x04\x00\x01\x00\x00\x99\xe9\xd8\x51"))
	f.Add([]byte("BZh91AY&SY"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c := detectCompression(data)
		if c == CompressionNone || c == CompressionXz {
			return
		}
		r, closeFn, err := decompress(context.Background(), c, bytes.NewReader(data))
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error %T is not *Error: %v", err, err)
			}
			return
		}
		defer closeFn()
		_, err = io.Copy(io.Discard, io.LimitReader(r, 4<<20))
		var ie *Error
		if err != nil && !errors.As(err, &ie) {
			t.Fatalf("decode error %T is not *Error: %v", err, err)
		}
	})
}

// FuzzQemuInfo: whatever qemu-img info prints, an image that passes the
// vetting has no backing file, no data file, no second child and, for
// VMDK, one extent that is the image itself.
func FuzzQemuInfo(f *testing.F) {
	f.Add(`{"virtual-size":65536,"format":"qcow2","format-specific":{"type":"qcow2","data":{"data-file":"/etc/passwd"}}}`, "qcow2")
	f.Add(`{"virtual-size":65536,"format":"vmdk","format-specific":{"type":"vmdk","data":{"create-type":"monolithicSparse","extents":[{"filename":"/in/image","format":"SPARSE"}]}}}`, "vmdk")
	f.Add(`{"virtual-size":1,"format":"vpc","backing-filename":"x"}`, "vpc")
	f.Fuzz(func(t *testing.T, js, format string) {
		var info qemuInfo
		if json.Unmarshal([]byte(js), &info) != nil {
			return
		}
		if info.vet(Format(format)) != nil {
			return
		}
		if info.BackingFilename != "" || info.FullBackingFilename != "" || info.Encrypted || info.Format != format {
			t.Fatalf("accepted %s", js)
		}
		var fs formatSpecific
		if len(info.FormatSpecific.Data) > 0 {
			if json.Unmarshal(info.FormatSpecific.Data, &fs) != nil {
				t.Fatalf("accepted unparsable format-specific data %s", js)
			}
		}
		if fs.DataFile != nil {
			t.Fatalf("accepted a data file: %s", js)
		}
		if format == string(FormatVMDK) && (len(fs.Extents) != 1 || fs.Extents[0].Filename != sandboxImage) {
			t.Fatalf("accepted vmdk extents: %s", js)
		}
		for _, c := range info.Children {
			if c.Name != "file" {
				t.Fatalf("accepted child %q", c.Name)
			}
		}
	})
}
