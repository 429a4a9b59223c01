package importer

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// fixture is a directory of images made once per test binary from one raw
// disk, by qemu-img and the compressors.
type fixture struct {
	dir    string
	rawSHA string
}

var (
	fixtureOnce sync.Once
	fixtureVal  *fixture
	fixtureErr  string
)

// imageCase is one image of the fixture and what importing it must give.
type imageCase struct {
	name     string
	format   Format
	comp     Compression
	streamed bool
	qemuFmt  string // how qemu-img reads it, for the reference checksum
}

var imageCases = []imageCase{
	{"disk.raw", FormatRaw, CompressionNone, true, "raw"},
	{"disk.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-v2.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-c.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-zstd.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-2m.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-512.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-prealloc.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-late.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-c-late.qcow2", FormatQcow2, CompressionNone, true, "qcow2"},
	{"disk-extl2.qcow2", FormatQcow2, CompressionNone, false, "qcow2"},
	{"disk.vmdk", FormatVMDK, CompressionNone, false, "vmdk"},
	{"disk-so.vmdk", FormatVMDK, CompressionNone, false, "vmdk"},
	{"disk.vhd", FormatVHD, CompressionNone, false, "vpc"},
	{"disk-fixed.vhd", FormatRaw, CompressionNone, true, "vpc"},
	{"disk.vhdx", FormatVHDX, CompressionNone, false, "vhdx"},
	{"disk.iso", FormatISO, CompressionNone, true, "raw"},
	{"disk.raw.gz", FormatRaw, CompressionGzip, true, ""},
	{"disk.raw.xz", FormatRaw, CompressionXz, true, ""},
	{"disk.raw.zst", FormatRaw, CompressionZstd, true, ""},
	{"disk.qcow2.gz", FormatQcow2, CompressionGzip, true, ""},
	{"disk.qcow2.xz", FormatQcow2, CompressionXz, true, ""},
	{"disk-c.qcow2.zst", FormatQcow2, CompressionZstd, true, ""},
	{"disk.vmdk.gz", FormatVMDK, CompressionGzip, false, ""},
	{"disk.qcow2.bz2", FormatQcow2, CompressionBzip2, true, ""},
	{"disk.iso.xz", FormatISO, CompressionXz, true, ""},
}

func TestMain(m *testing.M) {
	code := m.Run()
	if fixtureVal != nil {
		os.RemoveAll(fixtureVal.dir)
	}
	os.Exit(code)
}

func getFixture(t *testing.T) *fixture {
	t.Helper()
	fixtureOnce.Do(func() {
		dir, err := os.MkdirTemp("", "importer-fixture-")
		if err != nil {
			fixtureErr = err.Error()
			return
		}
		fixtureVal = &fixture{dir: dir}
		ok := t.Run("make-fixture", func(t *testing.T) { buildFixture(t, fixtureVal) })
		if !ok {
			fixtureErr = "building the image fixture failed"
		}
	})
	if fixtureErr != "" {
		t.Fatal(fixtureErr)
	}
	return fixtureVal
}

func buildFixture(t *testing.T, fx *fixture) {
	d := fx.dir
	p := func(n string) string { return filepath.Join(d, n) }
	raw := makeRawImage(t, d, "disk.raw", testImageSize, 1)
	fx.rawSHA = fileSHA(t, raw)
	conv := func(out string, args ...string) {
		run(t, "qemu-img", append(append([]string{"convert", "-f", "raw"}, args...), raw, p(out))...)
	}
	conv("disk.qcow2", "-O", "qcow2")
	conv("disk-v2.qcow2", "-O", "qcow2", "-o", "compat=0.10")
	conv("disk-c.qcow2", "-O", "qcow2", "-c")
	conv("disk-zstd.qcow2", "-O", "qcow2", "-c", "-o", "compression_type=zstd")
	conv("disk-2m.qcow2", "-O", "qcow2", "-o", "cluster_size=2M")
	conv("disk-512.qcow2", "-O", "qcow2", "-o", "cluster_size=512")
	conv("disk-prealloc.qcow2", "-O", "qcow2", "-o", "preallocation=metadata")
	conv("disk-extl2.qcow2", "-O", "qcow2", "-o", "extended_l2=on")
	conv("disk.vmdk", "-O", "vmdk")
	conv("disk-so.vmdk", "-O", "vmdk", "-o", "subformat=streamOptimized")
	conv("disk.vdi", "-O", "vdi")
	conv("disk.vhd", "-O", "vpc", "-o", "force_size=on")
	conv("disk-fixed.vhd", "-O", "vpc", "-o", "subformat=fixed,force_size=on")
	conv("disk.vhdx", "-O", "vhdx")
	relocateTables(t, p("disk.qcow2"), p("disk-late.qcow2"))
	relocateTables(t, p("disk-c.qcow2"), p("disk-c-late.qcow2"))

	isoDir := t.TempDir()
	makeRawImage(t, isoDir, "payload.bin", 8<<20, 2)
	run(t, "genisoimage", "-quiet", "-o", p("disk.iso"), "-V", "TESTISO", "-J", "-r", isoDir)

	sh := func(cmd string) { run(t, "sh", "-c", "cd "+d+" && "+cmd) }
	sh("gzip -1 -k disk.raw && xz -0 -T1 -k disk.raw && zstd -q -1 -k disk.raw")
	sh("gzip -1 -k disk.qcow2 && xz -0 -T1 -k disk.qcow2 && zstd -q -1 -k disk-c.qcow2")
	sh("gzip -1 -k disk.vmdk && xz -0 -T1 -k disk.iso && bzip2 -1 -k disk.qcow2")

	// Prove the fixture itself: every qemu-readable image holds the raw disk.
	for _, c := range imageCases {
		if c.qemuFmt == "" || c.name == "disk.iso" {
			continue
		}
		if got := guestSHA(t, p(c.name), c.qemuFmt); got != fx.rawSHA {
			t.Fatalf("fixture %s: qemu reads %s, want %s", c.name, got, fx.rawSHA)
		}
	}
}

// relocateTables rewrites a qcow2 image so that its L2 tables and then its
// L1 table come after all the data (a layout qemu never writes), to drive
// the spill path of the streaming converter.
func relocateTables(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	cs := 1 << be.Uint32(b[20:])
	l1Size := int(be.Uint32(b[36:]))
	l1Off := int(be.Uint64(b[40:]))
	pad := func() {
		for len(b)%cs != 0 {
			b = append(b, 0)
		}
	}
	pad()
	for i := range l1Size {
		e := be.Uint64(b[l1Off+8*i:])
		off := int(e & qcow2OffsetMask)
		if off == 0 {
			continue
		}
		at := len(b)
		b = append(b, b[off:off+cs]...)
		clear(b[off : off+cs])
		be.PutUint64(b[l1Off+8*i:], e&^qcow2OffsetMask|uint64(at))
	}
	at := len(b)
	b = append(b, b[l1Off:l1Off+8*l1Size]...)
	clear(b[l1Off : l1Off+8*l1Size])
	pad()
	be.PutUint64(b[40:], uint64(at))
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestFormatsOverHTTP(t *testing.T) {
	fx := getFixture(t)
	srv := serveDir(t, fx.dir)
	isoSHA := fileSHA(t, filepath.Join(fx.dir, "disk.iso"))
	for _, c := range imageCases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			dest := filepath.Join(dir, "disk.img")
			var last Progress
			res, err := Import(context.Background(), Request{
				Source:   Source{HTTP: &HTTPSource{AllowedNetworks: testNetworks, URL: srv.URL + "/" + c.name}},
				Dest:     dest,
				Capacity: 2 * testImageSize,
				Progress: func(p Progress) { last = p },
			})
			if err != nil {
				t.Fatalf("import: %v", err)
			}
			if res.Format != c.format || res.Compression != c.comp || res.Streamed != c.streamed {
				t.Errorf("result %+v, want format %s compression %q streamed %v", res, c.format, c.comp, c.streamed)
			}
			want := fx.rawSHA
			if c.format == FormatISO {
				want = isoSHA
			}
			if got := fileSHA(t, dest); got != want {
				t.Errorf("imported content %s, want %s", got, want)
			}
			if last.String() != "100.00%" {
				t.Errorf("last progress %s, want 100.00%%", last)
			}
			if left := leftovers(t, dir, "disk.img"); len(left) != 0 {
				t.Errorf("left behind: %v", left)
			}
		})
	}
}

// TestExpandAndReader imports from a reader of unknown length and grows the
// image to the capacity.
func TestExpandAndReader(t *testing.T) {
	fx := getFixture(t)
	f, err := os.Open(filepath.Join(fx.dir, "disk-c.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dest := filepath.Join(t.TempDir(), "disk.img")
	res, err := ImportFromReader(context.Background(), struct{ *os.File }{f}, -1, Request{
		Dest: dest, Capacity: 3 * testImageSize, ExpandToCapacity: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.VirtualSize != testImageSize {
		t.Errorf("virtual size %d, want %d", res.VirtualSize, testImageSize)
	}
	st, err := os.Stat(dest)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != 3*testImageSize {
		t.Errorf("size %d, want %d", st.Size(), 3*testImageSize)
	}
	if got := prefixSHA(t, dest, testImageSize); got != fx.rawSHA {
		t.Errorf("content %s, want %s", got, fx.rawSHA)
	}
}

func TestBlank(t *testing.T) {
	dest := filepath.Join(t.TempDir(), "disk.img")
	res, err := Import(context.Background(), Request{Source: Source{Blank: true}, Dest: dest, Capacity: 10 << 20})
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(dest)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != 10<<20 || res.VirtualSize != 10<<20 {
		t.Errorf("blank size %d / %d, want %d", st.Size(), res.VirtualSize, 10<<20)
	}
}
