package imagearchive

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// readTar returns the regular files and symlinks of a tar by name.
func readTar(t *testing.T, r io.Reader) (map[string][]byte, map[string]*tar.Header) {
	t.Helper()
	files, hdrs := map[string][]byte{}, map[string]*tar.Header{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files, hdrs
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name], hdrs[h.Name] = b, h
	}
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// The archive's OCI layout and docker manifest name the same blobs, every
// blob matches its digest, the config's diff_id is the uncompressed layer's,
// and the layer holds the files with parents, modes and links.
func TestWriteIsConsistentAndDeterministic(t *testing.T) {
	src := filepath.Join(t.TempDir(), "prog")
	if err := os.WriteFile(src, []byte("#!/bin/sh\necho hi\n"), 0o750); err != nil {
		t.Fatal(err)
	}
	img := Image{Names: []string{"localhost/nodevirt/test:v1"}, Entrypoint: []string{"/usr/local/bin/prog"},
		Labels: map[string]string{"a": "b"}, Created: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
		Files: []File{
			{Path: "/usr/local/bin/prog", Source: src, Mode: 0o755},
			{Path: "/etc/motd", Data: []byte("hello\n")},
			{Path: "/bin", Link: "usr/bin"},
			{Path: "/tmp", Dir: true, Mode: 0o1777},
		}}
	var a, b bytes.Buffer
	s, err := Write(&a, img)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Write(&b, img); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("two writes of the same image differ")
	}
	files, _ := readTar(t, bytes.NewReader(a.Bytes()))
	for name, data := range files {
		if d, ok := bytes.CutPrefix([]byte(name), []byte("blobs/sha256/")); ok && len(d) > 0 && sha(data) != "sha256:"+string(d) {
			t.Errorf("blob %s does not match its digest", name)
		}
	}
	var docker []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(files["manifest.json"], &docker); err != nil || len(docker) != 1 {
		t.Fatalf("manifest.json: %v %s", err, files["manifest.json"])
	}
	if docker[0].RepoTags[0] != "localhost/nodevirt/test:v1" || docker[0].Config != blobPath(s.ConfigDigest) ||
		docker[0].Layers[0] != blobPath(s.LayerDigest) {
		t.Errorf("docker manifest %+v does not match %+v", docker[0], s)
	}
	var index ociIndex
	if err := json.Unmarshal(files["index.json"], &index); err != nil || len(index.Manifests) != 1 {
		t.Fatalf("index.json: %v %s", err, files["index.json"])
	}
	if m := index.Manifests[0]; m.Digest != s.ManifestDigest || m.Annotations["io.containerd.image.name"] != "localhost/nodevirt/test:v1" ||
		m.Annotations["org.opencontainers.image.ref.name"] != "v1" {
		t.Errorf("index entry %+v", m)
	}
	var manifest ociManifest
	if err := json.Unmarshal(files[blobPath(s.ManifestDigest)], &manifest); err != nil {
		t.Fatal(err)
	}
	if manifest.Config.Digest != s.ConfigDigest || manifest.Layers[0].Digest != s.LayerDigest || manifest.Layers[0].Size != s.LayerSize {
		t.Errorf("oci manifest %+v", manifest)
	}
	var config configJSON
	if err := json.Unmarshal(files[blobPath(s.ConfigDigest)], &config); err != nil {
		t.Fatal(err)
	}
	if config.Config.Entrypoint[0] != "/usr/local/bin/prog" || config.Config.Labels["a"] != "b" || config.Created != "2026-01-02T03:04:05Z" {
		t.Errorf("config %+v", config)
	}

	zr, err := gzip.NewReader(bytes.NewReader(files[blobPath(s.LayerDigest)]))
	if err != nil {
		t.Fatal(err)
	}
	layer, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	if sha(layer) != config.RootFS.DiffIDs[0] || sha(layer) != s.DiffID {
		t.Error("diff_id is not the uncompressed layer's digest")
	}
	content, hdrs := readTar(t, bytes.NewReader(layer))
	if string(content["usr/local/bin/prog"]) != "#!/bin/sh\necho hi\n" || hdrs["usr/local/bin/prog"].Mode != 0o755 {
		t.Errorf("prog: %q mode %o", content["usr/local/bin/prog"], hdrs["usr/local/bin/prog"].Mode)
	}
	for _, dir := range []string{"usr/", "usr/local/", "usr/local/bin/", "etc/"} {
		if h := hdrs[dir]; h == nil || h.Typeflag != tar.TypeDir {
			t.Errorf("parent %s missing", dir)
		}
	}
	if h := hdrs["bin"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "usr/bin" {
		t.Errorf("symlink bin: %+v", h)
	}
	if h := hdrs["tmp/"]; h == nil || h.Mode != 0o1777&0o777 && h.Mode != 0o1777 {
		t.Errorf("tmp: %+v", h)
	}
	if !hdrs["etc/motd"].ModTime.Equal(img.Created) {
		t.Errorf("entry time %s, want the image's", hdrs["etc/motd"].ModTime)
	}
}

func TestWriteRefusesBadImages(t *testing.T) {
	for name, img := range map[string]Image{
		"no name":       {Files: []File{{Path: "/a", Data: []byte("x")}}},
		"no tag":        {Names: []string{"localhost/x"}},
		"relative path": {Names: []string{"x:1"}, Files: []File{{Path: "a", Data: []byte("x")}}},
		"twice":         {Names: []string{"x:1"}, Files: []File{{Path: "/a", Data: []byte("x")}, {Path: "/a/", Data: []byte("y")}}},
		"file parent":   {Names: []string{"x:1"}, Files: []File{{Path: "/a", Data: []byte("x")}, {Path: "/a/b", Data: []byte("y")}}},
	} {
		if _, err := Write(io.Discard, img); err == nil {
			t.Errorf("%s: written", name)
		}
	}
}

// A dynamically linked host program's libraries resolve to files that
// exist, the loader included; a static file has none.
func TestSharedLibraries(t *testing.T) {
	libs, err := SharedLibraries("/bin/sh")
	if err != nil {
		t.Fatal(err)
	}
	var loader bool
	for _, l := range libs {
		if _, err := os.Stat(l); err != nil {
			t.Errorf("library %s: %v", l, err)
		}
		loader = loader || filepath.Base(l) == "ld-linux-x86-64.so.2"
	}
	if len(libs) < 2 || !loader {
		t.Errorf("libraries of /bin/sh: %v", libs)
	}
	txt := filepath.Join(t.TempDir(), "notelf")
	if err := os.WriteFile(txt, []byte("text"), 0o644); err != nil {
		t.Fatal(err)
	}
	if l, err := SharedLibraries(txt); err != nil || len(l) != 0 {
		t.Errorf("a text file: %v, %v", l, err)
	}
}
