package importer

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// hostSecret is what a "host file" holds in these tests: a hostile image
// names it, and no volume may ever contain it.
const hostSecret = "HOST-SECRET-5f1c2e9a-only-on-the-host\n"

// hostileImage is an image that references something outside itself.
type hostileImage struct {
	name string
	// names is what the refusal message must name (the offending
	// reference), "" to skip.
	names string
	// qemuFmt is how unconfined qemu-img reads it: the test first proves
	// that doing so reads the host file ("" when qemu-img cannot, and the
	// refusal is only the allowlist's).
	qemuFmt string
}

// hostileFixture writes the hostile images into dir, with the host files
// they name in hostDir.
func hostileFixture(t *testing.T, dir, hostDir string) []hostileImage {
	t.Helper()
	secret := filepath.Join(hostDir, "secret")
	// 64 KiB of secret, so that a FLAT extent or data file has something
	// to read at every offset a small image maps.
	if err := os.WriteFile(secret, bytes.Repeat([]byte(hostSecret), 65536/len(hostSecret)+1), 0o600); err != nil {
		t.Fatal(err)
	}
	p := func(n string) string { return filepath.Join(dir, n) }
	write := func(n string, b []byte) {
		if err := os.WriteFile(p(n), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var out []hostileImage

	// A VMDK descriptor whose FLAT extent is a host file (CVE-2024-32498).
	write("flat-desc.vmdk", []byte(`# Disk DescriptorFile
version=1
CID=12345678
parentCID=ffffffff
createType="monolithicFlat"

# Extent description
RW 128 FLAT "`+secret+`" 0

ddb.virtualHWVersion = "4"
ddb.geometry.cylinders = "1"
ddb.geometry.heads = "16"
ddb.geometry.sectors = "63"
ddb.adapterType = "ide"
`))
	out = append(out, hostileImage{"flat-desc.vmdk", secret, "vmdk"})
	write("passwd-desc.vmdk", []byte("# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 4 FLAT \"/etc/passwd\" 0\n"))
	out = append(out, hostileImage{"passwd-desc.vmdk", "/etc/passwd", ""})

	// A multi-extent VMDK as qemu-img makes one: a descriptor naming two
	// sparse extent files; the second is replaced by the host file.
	run(t, "qemu-img", "create", "-q", "-f", "vmdk", "-o", "subformat=twoGbMaxExtentSparse", p("multi.vmdk"), "3G")
	desc, err := os.ReadFile(p("multi.vmdk"))
	if err != nil {
		t.Fatal(err)
	}
	desc = bytes.Replace(desc, []byte(`"multi-s002.vmdk"`), []byte(`"`+secret+`"`), 1)
	desc = bytes.Replace(desc, []byte("SPARSE \""+secret), []byte("FLAT \""+secret), 1)
	desc = bytes.Replace(desc, []byte(`"`+secret+`"`), []byte(`"`+secret+`" 0`), 1)
	write("multi.vmdk", desc)
	out = append(out, hostileImage{"multi.vmdk", secret, ""})

	// A monolithicSparse VMDK whose embedded descriptor gains a second,
	// FLAT extent on the host file, and one that gains a parent.
	run(t, "qemu-img", "create", "-q", "-f", "vmdk", p("sparse.vmdk"), "64M")
	sparse, err := os.ReadFile(p("sparse.vmdk"))
	if err != nil {
		t.Fatal(err)
	}
	patchDesc := func(name string, edit func(string) string) {
		b := bytes.Clone(sparse)
		off := int(binary.LittleEndian.Uint64(b[vmdkDescOffsetAt:])) * 512
		n := int(binary.LittleEndian.Uint64(b[vmdkDescSizeAt:])) * 512
		text := string(bytes.TrimRight(b[off:off+n], "\x00"))
		text = edit(text)
		if len(text) > n {
			t.Fatalf("patched descriptor does not fit")
		}
		copy(b[off:off+n], make([]byte, n))
		copy(b[off:], text)
		write(name, b)
	}
	patchDesc("two-extents.vmdk", func(s string) string {
		i := strings.Index(s, "RW ")
		j := i + strings.Index(s[i:], "\n") + 1
		return s[:j] + "RW 128 FLAT \"" + secret + "\" 0\n" + s[j:]
	})
	out = append(out, hostileImage{"two-extents.vmdk", secret, ""})
	patchDesc("parent.vmdk", func(s string) string {
		s = strings.Replace(s, "parentCID=ffffffff", "parentCID=12345678", 1)
		return strings.Replace(s, "createType=", "parentFileNameHint=\""+secret+"\"\ncreateType=", 1)
	})
	out = append(out, hostileImage{"parent.vmdk", secret, ""})

	// qcow2 with a backing file: the host's /etc/passwd, and the secret.
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", "/etc/passwd", p("backing-passwd.qcow2"), "64M")
	out = append(out, hostileImage{"backing-passwd.qcow2", "/etc/passwd", ""})
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", secret, p("backing.qcow2"), "64K")
	out = append(out, hostileImage{"backing.qcow2", secret, "qcow2"})

	// qcow2 with an external data file: qemu-img creates (empties) it, so
	// it is made on a copy and pointed at the secret afterwards.
	dataFile := filepath.Join(hostDir, "secre2") // as long as "secret"
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "data_file="+dataFile+",data_file_raw=on", p("datafile-tmp.qcow2"), "64K")
	b, err := os.ReadFile(p("datafile-tmp.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(p("datafile-tmp.qcow2"))
	b = bytes.Replace(b, []byte(dataFile), []byte(secret), 1)
	if !bytes.Contains(b, []byte(secret)) {
		t.Fatalf("data file name not patched")
	}
	write("datafile.qcow2", b)
	out = append(out, hostileImage{"datafile.qcow2", secret, "qcow2"})
	// The same with the incompatible "external data file" bit cleared: the
	// extension alone is refused.
	nb := bytes.Clone(b)
	nb[79] &^= qcow2IncompatDataFile
	write("datafile-nobit.qcow2", nb)
	out = append(out, hostileImage{"datafile-nobit.qcow2", secret, ""})

	// The same, wrapped: qcow2 with a backing file in gz, the FLAT
	// descriptor in xz, the data-file qcow2 in bz2 and zstd.
	sh := func(cmd string) { run(t, "sh", "-c", "cd "+dir+" && "+cmd) }
	sh("gzip -k backing.qcow2 && xz -k flat-desc.vmdk && bzip2 -k datafile.qcow2 && zstd -q -k -o datafile.qcow2.zst datafile.qcow2")
	out = append(out, hostileImage{"backing.qcow2.gz", secret, ""}, hostileImage{"flat-desc.vmdk.xz", secret, ""},
		hostileImage{"datafile.qcow2.bz2", secret, ""}, hostileImage{"datafile.qcow2.zst", secret, ""})

	// Formats off the allowlist or their differencing variants.
	run(t, "qemu-img", "create", "-q", "-f", "vdi", p("disk.vdi"), "64M")
	out = append(out, hostileImage{"disk.vdi", "vdi", ""})
	run(t, "qemu-img", "create", "-q", "-f", "vpc", p("dyn.vhd"), "64M")
	vhd, err := os.ReadFile(p("dyn.vhd"))
	if err != nil {
		t.Fatal(err)
	}
	binary.BigEndian.PutUint32(vhd[60:], vhdTypeDifferencing)
	write("diff.vhd", vhd)
	out = append(out, hostileImage{"diff.vhd", "differencing", ""})
	run(t, "qemu-img", "create", "-q", "-f", "vhdx", p("plain.vhdx"), "64M")
	write("diff.vhdx", vhdxWithParentBit(t, p("plain.vhdx")))
	out = append(out, hostileImage{"diff.vhdx", "HasParent", ""})
	return out
}

// vhdxWithParentBit sets HasParent in a VHDX's file parameters.
func vhdxWithParentBit(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	rt := b[vhdxRegionTableAt:]
	for i := range int(le.Uint32(rt[8:])) {
		e := rt[16+32*i:]
		if !bytes.Equal(e[:16], vhdxMetadataGUID) {
			continue
		}
		meta := int(le.Uint64(e[16:]))
		mt := b[meta:]
		for j := range int(le.Uint16(mt[10:])) {
			me := mt[32+32*j:]
			if bytes.Equal(me[:16], vhdxFileParams) {
				fp := meta + int(le.Uint32(me[16:]))
				b[fp+4] |= 2
				return b
			}
		}
	}
	t.Fatal("no vhdx file parameters found")
	return nil
}

// TestHostileImagesAreRefused imports every hostile image over HTTP, as an
// upload (a reader) and from a registry (which is also how containerDisks
// are pulled): each fails UnsupportedImage naming its reference, and no
// byte of the host file lands anywhere in the destination directory.
func TestHostileImagesAreRefused(t *testing.T) {
	dir, hostDir := t.TempDir(), t.TempDir()
	images := hostileFixture(t, dir, hostDir)
	srv := serveDir(t, dir)
	reg := &testRegistry{repo: "evil/disk", blobs: map[string][]byte{}, manifests: map[string]registryObject{}}
	regSrv := httptest.NewServer(reg)
	defer regSrv.Close()
	regHost := strings.TrimPrefix(regSrv.URL, "http://")

	for _, img := range images {
		t.Run(img.name, func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join(dir, img.name))
			if err != nil {
				t.Fatal(err)
			}
			if img.qemuFmt != "" {
				// The image is real: qemu-img, unconfined, reads the host file.
				ref := filepath.Join(t.TempDir(), "ref.raw")
				cmd := exec.Command("qemu-img", "convert", "-f", img.qemuFmt, "-O", "raw", filepath.Join(dir, img.name), ref)
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("unconfined qemu-img convert: %v\n%s", err, out)
				}
				if got, _ := os.ReadFile(ref); !bytes.Contains(got, []byte(hostSecret)) {
					t.Fatalf("the hostile image does not read the host file even unconfined")
				}
			}
			reg.containerDisk(t, strings.NewReplacer(".", "-").Replace(img.name), true, "disk/"+img.name, data)
			for _, via := range []string{"http", "upload", "registry"} {
				dest := filepath.Join(t.TempDir(), "disk.img")
				req := Request{Dest: dest, Capacity: 4 << 30}
				var err error
				switch via {
				case "http":
					req.HTTP = &HTTPSource{URL: srv.URL + "/" + img.name, Retries: -1, AllowedNetworks: testNetworks}
					_, err = Import(context.Background(), req)
				case "upload":
					_, err = ImportFromReader(context.Background(), bytes.NewReader(data), int64(len(data)), req)
				case "registry":
					req.Registry = &RegistrySource{URL: "docker://" + regHost + "/evil/disk:" + strings.NewReplacer(".", "-").Replace(img.name),
						InsecureRegistries: []string{regHost}, AllowedNetworks: testNetworks}
					_, err = Import(context.Background(), req)
				}
				if ReasonOf(err) != ReasonUnsupportedImage {
					t.Errorf("%s: %v, want %s", via, err, ReasonUnsupportedImage)
					continue
				}
				if !strings.Contains(err.Error(), img.names) {
					t.Errorf("%s: message %q does not name %q", via, err, img.names)
				}
				assertNoSecret(t, filepath.Dir(dest))
			}
		})
	}
}

// assertNoSecret fails if any file under dir holds the host secret (or
// the destination exists at all).
func assertNoSecret(t *testing.T, dir string) {
	t.Helper()
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		t.Errorf("refused import left %s", p)
		b, _ := os.ReadFile(p)
		if bytes.Contains(b, []byte(hostSecret)) {
			t.Errorf("host secret landed in %s", p)
		}
		return nil
	})
}

// TestQemuImgInfoVetting feeds the checks of qemu-img's own view the
// references qemu-img reports, as a second line behind the header checks.
func TestQemuImgInfoVetting(t *testing.T) {
	dir, hostDir := t.TempDir(), t.TempDir()
	images := hostileFixture(t, dir, hostDir)
	for _, img := range images {
		if img.qemuFmt == "" {
			continue
		}
		t.Run(img.name, func(t *testing.T) {
			info, err := qemuImgInfo(context.Background(), filepath.Join(dir, img.name), Format(img.qemuFmt))
			if err != nil {
				// The sandbox hides the host file: opening it fails.
				t.Logf("confined qemu-img info refuses it: %v", err)
				return
			}
			if err := info.vet(Format(img.qemuFmt)); ReasonOf(err) != ReasonUnsupportedImage {
				t.Errorf("vet %+v: %v, want %s", info, err, ReasonUnsupportedImage)
			}
		})
	}
	// And vetting of qemu-img info JSON as qemu-img prints it for such
	// images (the data-file case via format-specific).
	for _, js := range []string{
		`{"virtual-size":65536,"format":"qcow2","format-specific":{"type":"qcow2","data":{"compat":"1.1","data-file":"/etc/passwd","data-file-raw":true}}}`,
		`{"virtual-size":65536,"format":"qcow2","backing-filename":"/etc/passwd"}`,
		`{"virtual-size":65536,"format":"qcow2","children":[{"name":"file"},{"name":"data-file"}]}`,
		`{"virtual-size":65536,"format":"vmdk","format-specific":{"type":"vmdk","data":{"create-type":"monolithicFlat","extents":[{"filename":"/etc/passwd","format":"FLAT"}]}}}`,
		`{"virtual-size":65536,"format":"vmdk","format-specific":{"type":"vmdk","data":{"create-type":"monolithicSparse","extents":[{"filename":"/in/image","format":"SPARSE"},{"filename":"/etc/passwd","format":"FLAT"}]}}}`,
		`{"virtual-size":65536,"format":"qcow2","format-specific":{"type":"qcow2","data":{"encrypt":{"format":"luks"}}}}`,
	} {
		var info qemuInfo
		if err := jsonUnmarshal(js, &info); err != nil {
			t.Fatal(err)
		}
		if err := info.vet(Format(info.Format)); ReasonOf(err) != ReasonUnsupportedImage {
			t.Errorf("vet %s: %v, want %s", js, err, ReasonUnsupportedImage)
		}
	}
	ok := `{"virtual-size":65536,"format":"vmdk","format-specific":{"type":"vmdk","data":{"create-type":"streamOptimized","extents":[{"filename":"/in/image","format":"SPARSE"}]}}}`
	var info qemuInfo
	if err := jsonUnmarshal(ok, &info); err != nil {
		t.Fatal(err)
	}
	if err := info.vet(FormatVMDK); err != nil {
		t.Errorf("vet of a plain streamOptimized vmdk: %v", err)
	}
}

func jsonUnmarshal(s string, v any) error { return json.Unmarshal([]byte(s), v) }

// TestRawCopyNeverInterprets: a clone copies a volume whose guest wrote an
// image header (a qcow2 with a backing file, a VMDK descriptor naming a
// host file) byte for byte, as raw; nothing it names is read.
func TestRawCopyNeverInterprets(t *testing.T) {
	dir, hostDir := t.TempDir(), t.TempDir()
	hostileFixture(t, dir, hostDir)
	for _, name := range []string{"backing.qcow2", "flat-desc.vmdk", "datafile.qcow2", "backing.qcow2.gz"} {
		t.Run(name, func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				t.Fatal(err)
			}
			// A 1 MiB "volume" starting with the header.
			vol := make([]byte, 1<<20)
			copy(vol, data)
			dest := filepath.Join(t.TempDir(), "disk.img")
			res, err := ImportFromReader(context.Background(), bytes.NewReader(vol), int64(len(vol)),
				Request{Dest: dest, Capacity: 4 << 20, Raw: true})
			if err != nil {
				t.Fatal(err)
			}
			if res.Format != FormatRaw || res.VirtualSize != int64(len(vol)) {
				t.Errorf("result %+v, want raw of %d bytes", res, len(vol))
			}
			got, err := os.ReadFile(dest)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, vol) {
				t.Errorf("raw copy differs from the source")
			}
		})
	}
}

// TestRemoveLeftovers: what an interrupted import leaves next to its
// destination goes, the destination and other files stay.
func TestRemoveLeftovers(t *testing.T) {
	dir := t.TempDir()
	dest := filepath.Join(dir, "disk.img")
	keep := []string{"disk.img", "other.img", ".other.img.importing-1"}
	gone := []string{".disk.img.importing-123", ".disk.img.download.importing-9", ".disk.img.spill-77"}
	for _, n := range append(append([]string(nil), keep...), gone...) {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := RemoveLeftovers(dest); err != nil {
		t.Fatal(err)
	}
	left := leftovers(t, dir)
	if strings.Join(left, ",") != ".other.img.importing-1,disk.img,other.img" {
		t.Errorf("left %v, want only %v", left, keep)
	}
	// A name with glob metacharacters matches only itself.
	odd := filepath.Join(dir, "d[1]*.img")
	os.WriteFile(filepath.Join(dir, ".d[1]*.img.importing-5"), nil, 0o600)
	os.WriteFile(filepath.Join(dir, ".d1x.img.importing-5"), nil, 0o600)
	if err := RemoveLeftovers(odd); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, ".d1x.img.importing-5")); err != nil {
		t.Errorf("unrelated file removed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, ".d[1]*.img.importing-5")); err == nil {
		t.Errorf("leftover with an odd name kept")
	}
}
