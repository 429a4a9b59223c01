// Package registrytest is a small OCI distribution registry for tests of
// registry pulls (the registry client, containerDisks, DataImportCron
// polls): image manifests by tag or digest, blobs by digest,
// optional basic auth, blob download counts, and blobs that can be held
// back to make a slow pull.
package registrytest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
)

// Registry serves images over HTTP; it is an http.Handler.
type Registry struct {
	mu        sync.Mutex
	user      string // "" for anonymous access
	pass      string
	blobs     map[string][]byte
	manifests map[string][]byte // repo + "/" + tag or digest
	gets      map[string]int
	held      map[string]chan struct{} // repo -> closed when released
}

// New returns an empty registry.
func New() *Registry {
	return &Registry{blobs: map[string][]byte{}, manifests: map[string][]byte{}, gets: map[string]int{},
		held: map[string]chan struct{}{}}
}

// Serve serves the registry over plain HTTP on loopback and returns its
// host:port and the function that stops it.
func (r *Registry) Serve() (host string, stop func()) {
	srv := httptest.NewServer(r)
	return strings.TrimPrefix(srv.URL, "http://"), srv.Close
}

// SetAuth requires basic auth with user and pass ("" for anonymous access).
func (r *Registry) SetAuth(user, pass string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.user, r.pass = user, pass
}

// BlobGets is how often the blob digest was downloaded.
func (r *Registry) BlobGets(digest string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gets[digest]
}

// Blob returns a stored blob.
func (r *Registry) Blob(digest string) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.blobs[digest]
}

// Hold makes downloads of repo's blobs wait until release is called.
func (r *Registry) Hold(repo string) (release func()) {
	ch := make(chan struct{})
	r.mu.Lock()
	r.held[repo] = ch
	r.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

type descriptor struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
}

// Publish stores an image of one gzipped tar layer holding files (path in
// the image -> content) as repo:tag, and returns the manifest's digest and
// the layer's. A containerDisk holds one file under disk/.
func (r *Registry) Publish(repo, tag string, files map[string][]byte) (manifest, layer string, err error) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	slices.Sort(names)
	dirs := map[string]bool{}
	for _, name := range names {
		if d, _, ok := strings.Cut(name, "/"); ok && !dirs[d] {
			dirs[d] = true
			if err := tw.WriteHeader(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
				return "", "", err
			}
		}
		data := files[name]
		// KubeVirt's containerDisk images own their disk as uid 107 (qemu).
		if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o440, Uid: 107, Size: int64(len(data))}); err != nil {
			return "", "", err
		}
		if _, err := tw.Write(data); err != nil {
			return "", "", err
		}
	}
	if err := tw.Close(); err != nil {
		return "", "", err
	}
	if err := zw.Close(); err != nil {
		return "", "", err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	add := func(mediaType string, b []byte) descriptor {
		d := digestOf(b)
		r.blobs[d] = b
		return descriptor{MediaType: mediaType, Digest: d, Size: int64(len(b))}
	}
	cfg := add("application/vnd.oci.image.config.v1+json", []byte(`{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}`))
	l := add("application/vnd.oci.image.layer.v1.tar+gzip", buf.Bytes())
	m, err := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": cfg, "layers": []descriptor{l},
	})
	if err != nil {
		return "", "", err
	}
	d := digestOf(m)
	r.manifests[repo+"/"+tag] = m
	r.manifests[repo+"/"+d] = m
	return d, l.Digest, nil
}

// DockerConfigJSON is the .dockerconfigjson of a pull secret holding user
// and pass for host.
func DockerConfigJSON(host, user, pass string) []byte {
	auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
	return fmt.Appendf(nil, `{"auths":{%q:{"auth":%q}}}`, host, auth)
}

// ServeHTTP answers the distribution API's GETs.
func (r *Registry) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r.mu.Lock()
	if r.user != "" {
		if u, p, ok := req.BasicAuth(); !ok || u != r.user || p != r.pass {
			r.mu.Unlock()
			w.Header().Set("WWW-Authenticate", `Basic realm="registrytest"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
	}
	rest, ok := strings.CutPrefix(req.URL.Path, "/v2/")
	switch {
	case !ok:
		r.mu.Unlock()
		http.NotFound(w, req)
	case rest == "":
		r.mu.Unlock()
	case strings.Contains(rest, "/manifests/"):
		i := strings.LastIndex(rest, "/manifests/")
		m, ok := r.manifests[rest[:i]+"/"+rest[i+len("/manifests/"):]]
		r.mu.Unlock()
		if !ok {
			http.Error(w, `{"errors":[{"code":"MANIFEST_UNKNOWN"}]}`, http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
		w.Write(m)
	case strings.Contains(rest, "/blobs/"):
		i := strings.LastIndex(rest, "/blobs/")
		repo, d := rest[:i], rest[i+len("/blobs/"):]
		b, ok := r.blobs[d]
		hold := r.held[repo]
		if ok {
			r.gets[d]++
		}
		r.mu.Unlock()
		if !ok {
			http.Error(w, `{"errors":[{"code":"BLOB_UNKNOWN"}]}`, http.StatusNotFound)
			return
		}
		if hold != nil {
			select {
			case <-hold:
			case <-req.Context().Done():
				return
			}
		}
		w.Write(b)
	default:
		r.mu.Unlock()
		http.NotFound(w, req)
	}
}
