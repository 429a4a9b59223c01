// Package imagearchive writes a container image as one tar archive that
// `ctr images import`, `docker load` and `podman load` all read, without a
// base image and without a registry: one gzip-compressed layer holding the
// files given, an image config, and both an OCI image layout (index.json,
// oci-layout, blobs/sha256/…) and the docker-archive manifest.json pointing
// at the same blobs (as `docker save` writes since Docker 25).
//
// The archive is deterministic: entries are sorted, owned by root, and carry
// the image's creation time, so the same files give the same digests.
package imagearchive

import (
	"archive/tar"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"
	"time"
)

// File is one entry of the image's filesystem.
type File struct {
	// Path is absolute inside the image.
	Path string
	// Source is the host file whose content is copied (symlinks followed);
	// empty for a directory or a symlink.
	Source string
	// Data is the content when Source is empty and the entry is a file.
	Data []byte
	// Link makes the entry a symlink to Link.
	Link string
	// Dir makes the entry a directory.
	Dir bool
	// Mode is the permission bits (default 0755 for directories and
	// executables copied from the host keep theirs, 0644 for Data).
	Mode fs.FileMode
}

// Image is what goes into the archive.
type Image struct {
	// Names are the references the image is imported as, e.g.
	// localhost/nodevirt/nodeagent:v1.2.3; at least one.
	Names      []string
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
	User       string
	Labels     map[string]string
	// Created stamps the config and every tar entry (default: the Unix epoch).
	Created time.Time
	// Architecture and OS default to amd64 and linux.
	Architecture, OS string
	Files            []File
}

// Summary describes a written archive.
type Summary struct {
	// LayerDigest and DiffID are the compressed and uncompressed layer
	// digests; ManifestDigest names the image.
	LayerDigest, DiffID, ConfigDigest, ManifestDigest string
	// LayerSize is the compressed layer's size, UncompressedSize its tar's.
	LayerSize, UncompressedSize int64
	Files                       int
}

const (
	mediaManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaConfig   = "application/vnd.oci.image.config.v1+json"
	mediaLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"
	mediaIndex    = "application/vnd.oci.image.index.v1+json"
)

func (img *Image) validate() error {
	if len(img.Names) == 0 {
		return errors.New("image needs a name")
	}
	for _, n := range img.Names {
		if !strings.Contains(n, ":") || strings.HasSuffix(n, ":") {
			return fmt.Errorf("image name %q: want repository:tag", n)
		}
	}
	if img.Architecture == "" {
		img.Architecture = "amd64"
	}
	if img.OS == "" {
		img.OS = "linux"
	}
	if img.Created.IsZero() {
		img.Created = time.Unix(0, 0)
	}
	img.Created = img.Created.UTC()
	seen := map[string]bool{}
	for i := range img.Files {
		f := &img.Files[i]
		if !path.IsAbs(f.Path) {
			return fmt.Errorf("file %q: path must be absolute", f.Path)
		}
		f.Path = path.Clean(f.Path)
		if f.Path == "/" {
			return errors.New("file path / is the root itself")
		}
		if seen[f.Path] {
			return fmt.Errorf("file %s given twice", f.Path)
		}
		seen[f.Path] = true
	}
	return nil
}

// Write writes img's archive to w. The layer is staged in a temporary file,
// since the archive names it by its digest before its bytes.
func Write(w io.Writer, img Image) (Summary, error) {
	if err := img.validate(); err != nil {
		return Summary{}, err
	}
	tmp, err := os.CreateTemp("", "nodevirt-layer-*.tar.gz")
	if err != nil {
		return Summary{}, err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()

	var s Summary
	compressed := sha256.New()
	zw, err := gzip.NewWriterLevel(io.MultiWriter(tmp, compressed), gzip.BestCompression)
	if err != nil {
		return Summary{}, err
	}
	uncompressed := sha256.New()
	counter := &countWriter{w: io.MultiWriter(zw, uncompressed)}
	if s.Files, err = writeLayer(counter, img); err != nil {
		return Summary{}, fmt.Errorf("layer: %w", err)
	}
	if err := zw.Close(); err != nil {
		return Summary{}, err
	}
	s.UncompressedSize = counter.n
	s.DiffID, s.LayerDigest = digest(uncompressed), digest(compressed)
	if s.LayerSize, err = tmp.Seek(0, io.SeekCurrent); err != nil {
		return Summary{}, err
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return Summary{}, err
	}

	config, err := json.Marshal(imageConfig(img, s.DiffID))
	if err != nil {
		return Summary{}, err
	}
	s.ConfigDigest = digestOf(config)
	manifest, err := json.Marshal(ociManifest{SchemaVersion: 2, MediaType: mediaManifest,
		Config: descriptor{MediaType: mediaConfig, Digest: s.ConfigDigest, Size: int64(len(config))},
		Layers: []descriptor{{MediaType: mediaLayer, Digest: s.LayerDigest, Size: s.LayerSize}}})
	if err != nil {
		return Summary{}, err
	}
	s.ManifestDigest = digestOf(manifest)
	index := ociIndex{SchemaVersion: 2, MediaType: mediaIndex}
	for _, n := range img.Names {
		index.Manifests = append(index.Manifests, descriptor{MediaType: mediaManifest, Digest: s.ManifestDigest,
			Size: int64(len(manifest)), Annotations: map[string]string{
				// containerd names the image after the first; other
				// tools take the tag alone from the second.
				"io.containerd.image.name":          n,
				"org.opencontainers.image.ref.name": n[strings.LastIndex(n, ":")+1:],
			}})
	}
	indexJSON, err := json.Marshal(index)
	if err != nil {
		return Summary{}, err
	}
	dockerManifest, err := json.Marshal([]dockerEntry{{Config: blobPath(s.ConfigDigest), RepoTags: img.Names,
		Layers: []string{blobPath(s.LayerDigest)}}})
	if err != nil {
		return Summary{}, err
	}

	tw := tar.NewWriter(w)
	mtime := img.Created
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
			return Summary{}, err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: blobPath(s.LayerDigest), Size: s.LayerSize, Mode: 0o644, ModTime: mtime, Format: tar.FormatPAX}); err != nil {
		return Summary{}, err
	}
	if _, err := io.Copy(tw, tmp); err != nil {
		return Summary{}, fmt.Errorf("copy layer: %w", err)
	}
	for _, e := range []struct {
		name string
		data []byte
	}{
		{blobPath(s.ConfigDigest), config},
		{blobPath(s.ManifestDigest), manifest},
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", indexJSON},
		{"manifest.json", dockerManifest},
	} {
		if err := writeBytes(tw, e.name, e.data, 0o644, mtime); err != nil {
			return Summary{}, err
		}
	}
	return s, tw.Close()
}

// writeLayer writes the image's files as a tar, parents first, and returns
// how many entries it wrote.
func writeLayer(w io.Writer, img Image) (int, error) {
	entries := map[string]File{}
	for _, f := range img.Files {
		entries[f.Path] = f
		// Parents not given are plain directories.
		for d := path.Dir(f.Path); d != "/"; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				entries[d] = File{Path: d, Dir: true}
			}
		}
	}
	for _, f := range img.Files {
		if e := entries[path.Dir(f.Path)]; path.Dir(f.Path) != "/" && !e.Dir {
			return 0, fmt.Errorf("%s: parent %s is not a directory in the image", f.Path, e.Path)
		}
	}
	paths := make([]string, 0, len(entries))
	for p := range entries {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	tw := tar.NewWriter(w)
	for _, p := range paths {
		if err := writeEntry(tw, entries[p], img.Created); err != nil {
			return 0, fmt.Errorf("%s: %w", p, err)
		}
	}
	return len(paths), tw.Close()
}

func writeEntry(tw *tar.Writer, f File, mtime time.Time) error {
	name := strings.TrimPrefix(f.Path, "/")
	hdr := &tar.Header{Name: name, ModTime: mtime, Format: tar.FormatPAX, Uname: "root", Gname: "root"}
	switch {
	case f.Dir:
		hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, name+"/", int64(orMode(f.Mode, 0o755))
		return tw.WriteHeader(hdr)
	case f.Link != "":
		hdr.Typeflag, hdr.Linkname, hdr.Mode = tar.TypeSymlink, f.Link, 0o777
		return tw.WriteHeader(hdr)
	case f.Source != "":
		src, err := os.Open(f.Source)
		if err != nil {
			return err
		}
		defer src.Close()
		st, err := src.Stat()
		if err != nil {
			return err
		}
		if !st.Mode().IsRegular() {
			return fmt.Errorf("source %s is not a regular file", f.Source)
		}
		hdr.Typeflag, hdr.Size, hdr.Mode = tar.TypeReg, st.Size(), int64(orMode(f.Mode, st.Mode().Perm()))
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		n, err := io.Copy(tw, src)
		if err == nil && n != st.Size() {
			err = fmt.Errorf("source %s changed size while copied", f.Source)
		}
		return err
	default:
		return writeBytes(tw, name, f.Data, orMode(f.Mode, 0o644), mtime)
	}
}

func writeBytes(tw *tar.Writer, name string, data []byte, mode fs.FileMode, mtime time.Time) error {
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: int64(len(data)), Mode: int64(mode),
		ModTime: mtime, Format: tar.FormatPAX, Uname: "root", Gname: "root"}); err != nil {
		return err
	}
	_, err := tw.Write(data)
	return err
}

func orMode(m, def fs.FileMode) fs.FileMode {
	if m == 0 {
		return def
	}
	return m.Perm()
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func digest(h hash.Hash) string { return "sha256:" + hex.EncodeToString(h.Sum(nil)) }

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func blobPath(d string) string { return "blobs/sha256/" + strings.TrimPrefix(d, "sha256:") }

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type ociManifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

type ociIndex struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []descriptor `json:"manifests"`
}

type dockerEntry struct {
	Config   string
	RepoTags []string
	Layers   []string
}

// configJSON is the OCI image config (image-spec config.md).
type configJSON struct {
	Created      string         `json:"created"`
	Architecture string         `json:"architecture"`
	OS           string         `json:"os"`
	Config       runConfig      `json:"config"`
	RootFS       rootFS         `json:"rootfs"`
	History      []historyEntry `json:"history"`
}

type runConfig struct {
	User       string            `json:"User,omitempty"`
	Env        []string          `json:"Env,omitempty"`
	Entrypoint []string          `json:"Entrypoint,omitempty"`
	Cmd        []string          `json:"Cmd,omitempty"`
	WorkingDir string            `json:"WorkingDir,omitempty"`
	Labels     map[string]string `json:"Labels,omitempty"`
}

type rootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

type historyEntry struct {
	Created   string `json:"created"`
	CreatedBy string `json:"created_by"`
}

func imageConfig(img Image, diffID string) configJSON {
	created := img.Created.Format(time.RFC3339)
	return configJSON{Created: created, Architecture: img.Architecture, OS: img.OS,
		Config:  runConfig{User: img.User, Env: img.Env, Entrypoint: img.Entrypoint, Cmd: img.Cmd, WorkingDir: img.WorkingDir, Labels: img.Labels},
		RootFS:  rootFS{Type: "layers", DiffIDs: []string{diffID}},
		History: []historyEntry{{Created: created, CreatedBy: "nodevirt-image (clusterbrain/deploy/imagearchive)"}}}
}
