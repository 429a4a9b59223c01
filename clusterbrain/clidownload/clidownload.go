// Package clidownload serves virtctl for every supported platform at the
// paths upstream's download service (HCO's cli-download) uses, e.g.
// /amd64/linux/virtctl.tar.gz, /arm64/mac/virtctl.zip,
// /amd64/windows/virtctl.zip.
//
// Binaries come from a directory the build fills: a ready archive at the
// download path under it (dir/amd64/linux/virtctl.tar.gz) is served as is;
// otherwise the bare binary dir/virtctl-<os>-<arch>[.exe] is packed into the
// archive while it streams (nothing is held in memory).
package clidownload

import (
	"archive/tar"
	"archive/zip"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"html/template"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// Platform is one downloadable build.
type Platform struct {
	// Arch and OSDir are the path elements ("amd64", "mac").
	Arch, OSDir string
	// GOOS names the build ("darwin" for mac).
	GOOS string
	// Archive is "virtctl.tar.gz" or "virtctl.zip".
	Archive string
	Text    string
}

// Path is where the platform's archive is served.
func (p Platform) Path() string { return "/" + p.Arch + "/" + p.OSDir + "/" + p.Archive }

// Binary is the bare binary's file name in the directory.
func (p Platform) Binary() string {
	name := "virtctl-" + p.GOOS + "-" + p.Arch
	if p.GOOS == "windows" {
		name += ".exe"
	}
	return name
}

// member is the file name inside the archive.
func (p Platform) member() string {
	if p.GOOS == "windows" {
		return "virtctl.exe"
	}
	return "virtctl"
}

// Platforms are the builds nodevirt serves.
var Platforms = []Platform{
	{Arch: "amd64", OSDir: "linux", GOOS: "linux", Archive: "virtctl.tar.gz", Text: "Download virtctl for Linux for x86_64"},
	{Arch: "arm64", OSDir: "linux", GOOS: "linux", Archive: "virtctl.tar.gz", Text: "Download virtctl for Linux for ARM 64"},
	{Arch: "amd64", OSDir: "mac", GOOS: "darwin", Archive: "virtctl.zip", Text: "Download virtctl for Mac for x86_64"},
	{Arch: "arm64", OSDir: "mac", GOOS: "darwin", Archive: "virtctl.zip", Text: "Download virtctl for Mac for ARM 64"},
	{Arch: "amd64", OSDir: "windows", GOOS: "windows", Archive: "virtctl.zip", Text: "Download virtctl for Windows for x86_64"},
}

// DefaultDir is where an installed nodevirt keeps the virtctl builds.
const DefaultDir = "/usr/local/share/nodevirt/virtctl"

// Config configures the download server.
type Config struct {
	// Dir holds the builds (required).
	Dir string
	// Addr is where Run listens (default 127.0.0.1:8482).
	Addr string
	Log  *slog.Logger
}

// Server serves the downloads.
type Server struct {
	cfg Config
	mux *http.ServeMux
}

// New validates cfg and builds the server.
func New(cfg Config) (*Server, error) {
	if cfg.Dir == "" {
		return nil, errors.New("clidownload: dir is required")
	}
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:8482"
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	s := &Server{cfg: cfg, mux: http.NewServeMux()}
	s.mux.Handle("GET /{$}", httperr.TextHandler(s.index))
	for _, p := range Platforms {
		s.mux.Handle("GET "+p.Path(), httperr.TextHandler(func(w http.ResponseWriter, r *http.Request) error { return s.serve(w, r, p) }))
	}
	return s, nil
}

// Handler returns the HTTP handler (for mounting elsewhere and tests).
func (s *Server) Handler() http.Handler { return s.mux }

// Name implements the brain's Role.
func (s *Server) Name() string { return "cli-download" }

// Run serves on cfg.Addr until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", s.cfg.Addr, err)
	}
	srv := &http.Server{Handler: s.mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shut)
	}()
	s.cfg.Log.Info("serving virtctl downloads", "addr", ln.Addr().String(), "dir", s.cfg.Dir)
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request, p Platform) error {
	archive := filepath.Join(s.cfg.Dir, p.Arch, p.OSDir, p.Archive)
	if f, err := os.Open(archive); err == nil {
		defer f.Close()
		if st, err := f.Stat(); err == nil && st.Mode().IsRegular() {
			http.ServeContent(w, r, p.Archive, st.ModTime(), f)
			return nil
		}
	}
	bin := filepath.Join(s.cfg.Dir, p.Binary())
	f, err := os.Open(bin)
	if err != nil {
		return httperr.NotFound("virtctl for %s/%s is not built: neither %s nor %s exists (build it with make)",
			p.GOOS, p.Arch, archive, bin)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		return httperr.NotFound("virtctl for %s/%s: %s is not a file", p.GOOS, p.Arch, bin)
	}
	ctype := "application/zip"
	if p.Archive == "virtctl.tar.gz" {
		ctype = "application/gzip"
	}
	w.Header().Set("Content-Type", ctype)
	w.Header().Set("Content-Disposition", `attachment; filename="`+p.Archive+`"`)
	w.Header().Set("Last-Modified", st.ModTime().UTC().Format(http.TimeFormat))
	if r.Method == http.MethodHead {
		return nil
	}
	if p.Archive == "virtctl.tar.gz" {
		err = writeTarGz(w, f, st, p.member())
	} else {
		err = writeZip(w, f, st, p.member())
	}
	if err != nil {
		// Headers are gone: the client sees a truncated archive.
		s.cfg.Log.Warn("virtctl download failed", "path", r.URL.Path, "remote", r.RemoteAddr, "err", err)
	}
	return nil
}

func writeTarGz(w io.Writer, f io.Reader, st os.FileInfo, name string) error {
	gz, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
	tw := tar.NewWriter(gz)
	hdr := &tar.Header{Name: name, Mode: 0o755, Size: st.Size(), ModTime: st.ModTime(), Typeflag: tar.TypeReg}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	if _, err := io.Copy(tw, f); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return gz.Close()
}

func writeZip(w io.Writer, f io.Reader, st os.FileInfo, name string) error {
	zw := zip.NewWriter(w)
	hdr := &zip.FileHeader{Name: name, Method: zip.Deflate, Modified: st.ModTime()}
	hdr.SetMode(0o755)
	fw, err := zw.CreateHeader(hdr)
	if err != nil {
		return err
	}
	if _, err := io.Copy(fw, f); err != nil {
		return err
	}
	return zw.Close()
}

var indexPage = template.Must(template.New("index").Parse(`<!DOCTYPE html>
<html><head><title>virtctl - KubeVirt command line interface</title></head><body>
<h1>virtctl - KubeVirt command line interface</h1>
<ul>{{range .}}<li>{{if .Built}}<a href="{{.Path}}">{{.Text}}</a>{{else}}{{.Text}} (not built){{end}}</li>
{{end}}</ul></body></html>
`))

func (s *Server) index(w http.ResponseWriter, _ *http.Request) error {
	type entry struct {
		Path, Text string
		Built      bool
	}
	var es []entry
	for _, p := range Platforms {
		_, errA := os.Stat(filepath.Join(s.cfg.Dir, p.Arch, p.OSDir, p.Archive))
		_, errB := os.Stat(filepath.Join(s.cfg.Dir, p.Binary()))
		es = append(es, entry{Path: p.Path(), Text: p.Text, Built: errA == nil || errB == nil})
	}
	var page bytes.Buffer
	if err := indexPage.Execute(&page, es); err != nil {
		return fmt.Errorf("render the download page: %w", err)
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = w.Write(page.Bytes())
	return nil
}
