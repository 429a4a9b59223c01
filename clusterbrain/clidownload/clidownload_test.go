package clidownload

import (
	"archive/tar"
	"archive/zip"
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func get(t *testing.T, url string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, body
}

func untar(t *testing.T, data []byte) (string, int64, []byte) {
	t.Helper()
	gz, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	hdr, err := tr.Next()
	if err != nil {
		t.Fatal(err)
	}
	content, err := io.ReadAll(tr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Next(); err != io.EOF {
		t.Errorf("more than one member: %v", err)
	}
	return hdr.Name, hdr.Mode, content
}

func unzip(t *testing.T, data []byte) (string, os.FileMode, []byte) {
	t.Helper()
	zr, err := zip.NewReader(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	if len(zr.File) != 1 {
		t.Fatalf("%d members", len(zr.File))
	}
	f := zr.File[0]
	rc, err := f.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	content, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return f.Name, f.Mode(), content
}

func TestServesEveryPlatformAtUpstreamPaths(t *testing.T) {
	dir := t.TempDir()
	builds := map[string][]byte{}
	for _, p := range Platforms {
		if p.GOOS == "linux" && p.Arch == "arm64" {
			continue // left unbuilt
		}
		data := make([]byte, 3<<20)
		_, _ = rand.Read(data)
		builds[p.Path()] = data
		if err := os.WriteFile(filepath.Join(dir, p.Binary()), data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A ready archive is served as is.
	ready := filepath.Join(dir, "arm64", "mac")
	if err := os.MkdirAll(ready, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ready, "virtctl.zip"), []byte("prepacked"), 0o644); err != nil {
		t.Fatal(err)
	}

	s, err := New(Config{Dir: dir, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()

	for _, path := range []string{"/amd64/linux/virtctl.tar.gz", "/amd64/mac/virtctl.zip", "/amd64/windows/virtctl.zip"} {
		resp, body := get(t, srv.URL+path)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, body)
		}
		var name string
		var content []byte
		var exec bool
		if strings.HasSuffix(path, ".tar.gz") {
			var mode int64
			name, mode, content = untar(t, body)
			exec = mode&0o111 != 0
		} else {
			var mode os.FileMode
			name, mode, content = unzip(t, body)
			exec = mode&0o111 != 0
		}
		wantName := "virtctl"
		if strings.Contains(path, "windows") {
			wantName = "virtctl.exe"
		}
		if name != wantName || !exec || !bytes.Equal(content, builds[path]) {
			t.Errorf("%s: member %q exec %v, %d bytes (same content %v)", path, name, exec, len(content), bytes.Equal(content, builds[path]))
		}
	}

	resp, body := get(t, srv.URL+"/arm64/mac/virtctl.zip")
	if resp.StatusCode != http.StatusOK || string(body) != "prepacked" {
		t.Errorf("ready archive: %d %q", resp.StatusCode, body)
	}

	resp, body = get(t, srv.URL+"/arm64/linux/virtctl.tar.gz")
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), "virtctl for linux/arm64 is not built") ||
		!strings.Contains(string(body), "virtctl-linux-arm64") {
		t.Errorf("missing build: %d %q", resp.StatusCode, body)
	}
	resp, _ = get(t, srv.URL+"/s390x/linux/virtctl.tar.gz")
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("unserved platform: %d", resp.StatusCode)
	}

	resp, body = get(t, srv.URL+"/")
	page := string(body)
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, `href="/amd64/windows/virtctl.zip"`) ||
		!strings.Contains(page, "Download virtctl for Linux for ARM 64 (not built)") {
		t.Errorf("index: %d %s", resp.StatusCode, page)
	}

	head, err := http.Head(srv.URL + "/amd64/linux/virtctl.tar.gz")
	if err != nil {
		t.Fatal(err)
	}
	head.Body.Close()
	if head.StatusCode != http.StatusOK || head.Header.Get("Content-Type") != "application/gzip" {
		t.Errorf("head: %d %v", head.StatusCode, head.Header)
	}
}

func TestNewRequiresADirectory(t *testing.T) {
	if _, err := New(Config{}); err == nil {
		t.Error("accepted an empty dir")
	}
}
