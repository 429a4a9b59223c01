package importer

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry"
)

// testRegistry is a tiny OCI distribution server: manifests and blobs by
// digest or tag, and optionally a bearer-token challenge whose token
// endpoint wants basic credentials.
type testRegistry struct {
	mu        sync.Mutex
	repo      string
	blobs     map[string][]byte
	manifests map[string]registryObject
	token     string // required bearer token, "" for none
	user      string
	pass      string
	corrupt   string // a blob digest served with a flipped byte
}

type registryObject struct {
	mediaType string
	body      []byte
}

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

func (reg *testRegistry) addBlob(b []byte) registry.Descriptor {
	d := digestOf(b)
	reg.blobs[d] = b
	return registry.Descriptor{Digest: d, Size: int64(len(b))}
}

func (reg *testRegistry) addManifest(tag, mediaType string, v any) registry.Descriptor {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	d := digestOf(b)
	reg.manifests[d] = registryObject{mediaType, b}
	if tag != "" {
		reg.manifests[tag] = registryObject{mediaType, b}
	}
	return registry.Descriptor{MediaType: mediaType, Digest: d, Size: int64(len(b))}
}

func (reg *testRegistry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	if r.URL.Path == "/token" {
		if u, p, _ := r.BasicAuth(); u != reg.user || p != reg.pass {
			http.Error(w, "bad credentials", http.StatusUnauthorized)
			return
		}
		if r.URL.Query().Get("scope") != "repository:"+reg.repo+":pull" || r.URL.Query().Get("service") != "test" {
			http.Error(w, "bad scope", http.StatusBadRequest)
			return
		}
		json.NewEncoder(w).Encode(map[string]string{"token": reg.token})
		return
	}
	if reg.token != "" && r.Header.Get("Authorization") != "Bearer "+reg.token {
		scheme := "http"
		if r.TLS != nil {
			scheme = "https"
		}
		w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm="%s://%s/token",service="test",scope="repository:%s:pull"`, scheme, r.Host, reg.repo))
		http.Error(w, "auth", http.StatusUnauthorized)
		return
	}
	if r.URL.Path == "/v2/" {
		return
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/v2/"+reg.repo+"/")
	if !ok {
		http.NotFound(w, r)
		return
	}
	switch kind, ref, _ := strings.Cut(rest, "/"); kind {
	case "manifests":
		m, ok := reg.manifests[ref]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", m.mediaType)
		w.Write(m.body)
	case "blobs":
		b, ok := reg.blobs[ref]
		if !ok {
			http.NotFound(w, r)
			return
		}
		if ref == reg.corrupt {
			b = bytes.Clone(b)
			b[len(b)/2] ^= 1
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(b)
	default:
		http.NotFound(w, r)
	}
}

// tarLayer builds a layer holding files (name -> content), gzipped if asked.
func tarLayer(t *testing.T, gz bool, files map[string][]byte, names ...string) []byte {
	t.Helper()
	var buf bytes.Buffer
	var tw *tar.Writer
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		tw = tar.NewWriter(zw)
	} else {
		tw = tar.NewWriter(&buf)
	}
	for _, n := range names {
		if strings.HasSuffix(n, "/") {
			tw.WriteHeader(&tar.Header{Name: n, Typeflag: tar.TypeDir, Mode: 0o755})
			continue
		}
		tw.WriteHeader(&tar.Header{Name: n, Typeflag: tar.TypeReg, Mode: 0o440, Uid: 107, Size: int64(len(files[n]))})
		tw.Write(files[n])
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if zw != nil {
		zw.Close()
	}
	return buf.Bytes()
}

// containerDisk publishes a two-layer image (base files, then the disk) as
// repo:tag behind an index with an arm64 decoy, and returns the amd64
// manifest digest.
func (reg *testRegistry) containerDisk(t *testing.T, tag string, gz bool, diskName string, disk []byte) string {
	t.Helper()
	cfg := reg.addBlob([]byte(`{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}`))
	cfg.MediaType = "application/vnd.oci.image.config.v1+json"
	base := reg.addBlob(tarLayer(t, gz, map[string][]byte{"etc/hostname": []byte("x\n")}, "etc/", "etc/hostname"))
	layer := reg.addBlob(tarLayer(t, gz, map[string][]byte{diskName: disk}, "disk/", diskName))
	mt := "application/vnd.oci.image.layer.v1.tar"
	if gz {
		mt += "+gzip"
	}
	base.MediaType, layer.MediaType = mt, mt
	man := reg.addManifest("", registry.MediaOCIManifest, map[string]any{
		"schemaVersion": 2, "mediaType": registry.MediaOCIManifest, "config": cfg, "layers": []registry.Descriptor{base, layer},
	})
	decoy := man
	decoy.Digest = digestOf([]byte("not here"))
	type platformed struct {
		registry.Descriptor
		Platform map[string]string `json:"platform"`
	}
	reg.addManifest(tag, registry.MediaOCIIndex, map[string]any{
		"schemaVersion": 2, "mediaType": registry.MediaOCIIndex,
		"manifests": []platformed{
			{decoy, map[string]string{"os": "linux", "architecture": "arm64"}},
			{man, map[string]string{"os": "linux", "architecture": "amd64"}},
		},
	})
	return man.Digest
}

func TestRegistry(t *testing.T) {
	fx := getFixture(t)
	reg := &testRegistry{
		repo: "kubevirt/fedora", blobs: map[string][]byte{}, manifests: map[string]registryObject{},
		token: "tok-123", user: "puller", pass: "pw",
	}
	reg.containerDisk(t, "qcow2", true, "disk/disk.qcow2", readFixture(t, "disk-c.qcow2"))
	rawDigest := reg.containerDisk(t, "raw", false, "disk/disk.img", readFixture(t, "disk.raw"))
	reg.containerDisk(t, "nodisk", true, "other/disk.img", []byte("x"))
	badDigest := reg.containerDisk(t, "corrupt", true, "disk/disk.qcow2", readFixture(t, "disk.qcow2"))
	var badManifest registry.Manifest
	json.Unmarshal(reg.manifests[badDigest].body, &badManifest)
	reg.corrupt = badManifest.Layers[1].Digest

	plain := httptest.NewServer(reg)
	defer plain.Close()
	secure := quietTLSServer(reg)
	defer secure.Close()
	plainHost := strings.TrimPrefix(plain.URL, "http://")
	secureHost := strings.TrimPrefix(secure.URL, "https://")
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: secure.Certificate().Raw})

	imp := func(src RegistrySource) (string, Result, error) {
		dir := t.TempDir()
		dest := filepath.Join(dir, "disk.img")
		if src.Username == "" {
			src.Username, src.Password = "puller", "pw"
		}
		if src.AllowedNetworks == nil {
			src.AllowedNetworks = testNetworks
		}
		res, err := Import(context.Background(), Request{Source: Source{Registry: &src}, Dest: dest, Capacity: testImageSize})
		if err != nil {
			if left := leftovers(t, dir); len(left) != 0 {
				t.Errorf("failed import left %v", left)
			}
		}
		return dest, res, err
	}

	t.Run("insecure plain http, bearer token, index", func(t *testing.T) {
		dest, res, err := imp(RegistrySource{URL: "docker://" + plainHost + "/kubevirt/fedora:qcow2", InsecureRegistries: []string{plainHost}})
		if err != nil {
			t.Fatal(err)
		}
		if res.Format != FormatQcow2 || !res.Streamed {
			t.Errorf("result %+v", res)
		}
		if got := fileSHA(t, dest); got != fx.rawSHA {
			t.Errorf("content %s, want %s", got, fx.rawSHA)
		}
	})
	t.Run("tls with ca bundle, by digest, uncompressed layer", func(t *testing.T) {
		dest, _, err := imp(RegistrySource{URL: "docker://" + secureHost + "/kubevirt/fedora@" + rawDigest, CACertPEM: ca})
		if err != nil {
			t.Fatal(err)
		}
		if got := fileSHA(t, dest); got != fx.rawSHA {
			t.Errorf("content %s, want %s", got, fx.rawSHA)
		}
	})
	t.Run("untrusted tls", func(t *testing.T) {
		_, _, err := imp(RegistrySource{URL: "docker://" + secureHost + "/kubevirt/fedora:raw"})
		wantReason(t, err, ReasonSourceUnreachable)
	})
	t.Run("insecure tls without ca", func(t *testing.T) {
		if _, _, err := imp(RegistrySource{URL: "docker://" + secureHost + "/kubevirt/fedora:raw", InsecureRegistries: []string{secureHost}}); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("plain http not declared insecure", func(t *testing.T) {
		_, _, err := imp(RegistrySource{URL: "docker://" + plainHost + "/kubevirt/fedora:raw"})
		wantReason(t, err, ReasonSourceUnreachable)
	})
	t.Run("unknown tag", func(t *testing.T) {
		_, _, err := imp(RegistrySource{URL: "docker://" + plainHost + "/kubevirt/fedora:nope", InsecureRegistries: []string{plainHost}})
		wantReason(t, err, ReasonSourceNotFound)
	})
	t.Run("wrong password", func(t *testing.T) {
		_, _, err := imp(RegistrySource{URL: "docker://" + plainHost + "/kubevirt/fedora:raw", InsecureRegistries: []string{plainHost},
			Username: "puller", Password: "nope"})
		wantReason(t, err, ReasonUnauthorized)
	})
	t.Run("blob digest mismatch", func(t *testing.T) {
		_, _, err := imp(RegistrySource{URL: "docker://" + plainHost + "/kubevirt/fedora:corrupt", InsecureRegistries: []string{plainHost}})
		wantReason(t, err, ReasonChecksumMismatch)
	})
	t.Run("no disk in image", func(t *testing.T) {
		_, _, err := imp(RegistrySource{URL: "docker://" + plainHost + "/kubevirt/fedora:nodisk", InsecureRegistries: []string{plainHost}})
		wantReason(t, err, ReasonInvalidImage)
	})
	t.Run("bad url", func(t *testing.T) {
		_, _, err := imp(RegistrySource{URL: "https://" + plainHost + "/kubevirt/fedora"})
		wantReason(t, err, ReasonInvalidRequest)
	})
}
