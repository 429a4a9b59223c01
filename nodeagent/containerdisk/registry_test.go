package containerdisk

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// loopRegistry is a small OCI distribution server on loopback: image
// manifests by tag or digest, blobs by digest, optional basic auth. It
// counts blob downloads.
type loopRegistry struct {
	mu        sync.Mutex
	user      string // "" for anonymous access
	pass      string
	blobs     map[string][]byte
	manifests map[string][]byte // repo + "/" + tag or digest
	blobGets  map[string]int
}

func newLoopRegistry() *loopRegistry {
	return &loopRegistry{blobs: map[string][]byte{}, manifests: map[string][]byte{}, blobGets: map[string]int{}}
}

func sha256Digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

func (reg *loopRegistry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	if reg.user != "" {
		if u, p, ok := r.BasicAuth(); !ok || u != reg.user || p != reg.pass {
			w.Header().Set("WWW-Authenticate", `Basic realm="loop"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
	}
	if r.URL.Path == "/v2/" {
		return
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/v2/")
	if !ok {
		http.NotFound(w, r)
		return
	}
	if i := strings.LastIndex(rest, "/manifests/"); i >= 0 {
		m, ok := reg.manifests[rest[:i]+"/"+rest[i+len("/manifests/"):]]
		if !ok {
			http.Error(w, `{"errors":[{"code":"MANIFEST_UNKNOWN"}]}`, http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
		w.Write(m)
		return
	}
	if i := strings.LastIndex(rest, "/blobs/"); i >= 0 {
		d := rest[i+len("/blobs/"):]
		b, ok := reg.blobs[d]
		if !ok {
			http.NotFound(w, r)
			return
		}
		reg.blobGets[d]++
		w.Write(b)
		return
	}
	http.NotFound(w, r)
}

type descriptor struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
}

func (reg *loopRegistry) blob(mediaType string, b []byte) descriptor {
	d := sha256Digest(b)
	reg.blobs[d] = b
	return descriptor{MediaType: mediaType, Digest: d, Size: int64(len(b))}
}

// publish stores an image of one gzipped layer holding files as repo:tag
// and returns its manifest digest and the layer's digest.
func (reg *loopRegistry) publish(t *testing.T, repo, tag string, files map[string][]byte) (manifest, layer string) {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	dirs := map[string]bool{}
	for name, data := range files {
		if d, _, ok := strings.Cut(name, "/"); ok && !dirs[d] {
			dirs[d] = true
			tw.WriteHeader(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755})
		}
		tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o440, Uid: 107, Size: int64(len(data))})
		tw.Write(data)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	zw.Close()
	reg.mu.Lock()
	defer reg.mu.Unlock()
	cfg := reg.blob("application/vnd.oci.image.config.v1+json", []byte(`{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}`))
	l := reg.blob("application/vnd.oci.image.layer.v1.tar+gzip", buf.Bytes())
	m, err := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": cfg, "layers": []descriptor{l},
	})
	if err != nil {
		t.Fatal(err)
	}
	d := sha256Digest(m)
	reg.manifests[repo+"/"+tag] = m
	reg.manifests[repo+"/"+d] = m
	return d, l.Digest
}

func (reg *loopRegistry) gets(digest string) int {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	return reg.blobGets[digest]
}

func (reg *loopRegistry) setAuth(user, pass string) {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	reg.user, reg.pass = user, pass
}
