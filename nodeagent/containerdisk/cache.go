package containerdisk

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nodevirt/nodevirt/nodeagent/importer"
)

// The cache's layout under Config.Dir:
//
//	images/<algo>-<hex>[-<path hash>]/disk.img    the raw disk (0644)
//	images/<...>/entry.json                       what it is (entryRecord)
//	images/<...>/users/<owner>                     one empty file per user
//	refs/<hash of name and path>.json              the digest a name had at its last pull
//	tmp/                                           pulls under way
const (
	imagesDir = "images"
	refsDir   = "refs"
	tmpDir    = "tmp"
	diskFile  = "disk.img"
	entryFile = "entry.json"
	usersDir  = "users"
)

type entryRecord struct {
	Reference   string    `json:"reference"`
	Digest      string    `json:"digest"`
	Path        string    `json:"path,omitempty"`
	VirtualSize int64     `json:"virtualSize"`
	Pulled      time.Time `json:"pulled"`
}

type refRecord struct {
	Reference string `json:"reference"`
	Path      string `json:"path,omitempty"`
	Digest    string `json:"digest"`
}

func (p *Puller) sub(parts ...string) string {
	return filepath.Join(append([]string{p.cfg.Dir}, parts...)...)
}

func (p *Puller) initDirs() error {
	for _, d := range []string{"", imagesDir, refsDir} {
		if err := os.MkdirAll(p.sub(d), 0o755); err != nil {
			return fmt.Errorf("containerdisk cache: %w", err)
		}
		if err := os.Chmod(p.sub(d), 0o755); err != nil {
			return fmt.Errorf("containerdisk cache: %w", err)
		}
	}
	if err := os.RemoveAll(p.sub(tmpDir)); err != nil {
		return fmt.Errorf("containerdisk cache: clear interrupted pulls: %w", err)
	}
	if err := os.Mkdir(p.sub(tmpDir), 0o700); err != nil {
		return fmt.Errorf("containerdisk cache: %w", err)
	}
	return nil
}

func hashOf(parts ...string) string {
	s := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	return hex.EncodeToString(s[:])
}

// entryName is the directory of the image digest with its disk at path.
func entryName(digest, path string) string {
	name := strings.Replace(digest, ":", "-", 1)
	if path = cleanPath(path); path != "" {
		name += "-" + hashOf(path)[:12]
	}
	return name
}

// entry returns the cached image digest+path, if complete.
func (p *Puller) entry(digest, path string) (Image, bool) {
	e, err := p.readEntry(entryName(digest, path))
	if err != nil {
		return Image{}, false
	}
	return e.img, true
}

type cacheEntry struct {
	dir string
	img Image
	rec entryRecord
}

func (p *Puller) readEntry(name string) (*cacheEntry, error) {
	dir := p.sub(imagesDir, name)
	b, err := os.ReadFile(filepath.Join(dir, entryFile))
	if err != nil {
		return nil, err
	}
	var rec entryRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("cached image %s: %w", name, err)
	}
	disk := filepath.Join(dir, diskFile)
	if _, err := os.Stat(disk); err != nil {
		return nil, err
	}
	return &cacheEntry{dir: dir, rec: rec, img: Image{
		Reference: rec.Reference, Digest: rec.Digest, Path: disk, VirtualSize: rec.VirtualSize,
	}}, nil
}

func (e *cacheEntry) users() ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(e.dir, usersDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, u := range ents {
		out = append(out, u.Name())
	}
	return out, nil
}

// entries lists the complete cached images.
func (p *Puller) entries() ([]*cacheEntry, error) {
	ents, err := os.ReadDir(p.sub(imagesDir))
	if err != nil {
		return nil, fmt.Errorf("containerdisk cache: %w", err)
	}
	var out []*cacheEntry
	var errs []error
	for _, d := range ents {
		e, err := p.readEntry(d.Name())
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, e)
	}
	return out, errors.Join(errs...)
}

// local returns the image the name had at its last pull, if still cached.
func (p *Puller) local(ref Reference, path string) (Image, bool) {
	digest := ref.Digest
	if digest == "" {
		b, err := os.ReadFile(p.refPath(ref, path))
		if err != nil {
			return Image{}, false
		}
		var rr refRecord
		if json.Unmarshal(b, &rr) != nil || rr.Digest == "" {
			return Image{}, false
		}
		digest = rr.Digest
	}
	return p.entry(digest, path)
}

func (p *Puller) refPath(ref Reference, path string) string {
	return p.sub(refsDir, hashOf(ref.String(), cleanPath(path))[:32]+".json")
}

// writeRef remembers that the name resolved to digest.
func (p *Puller) writeRef(ref Reference, path, digest string) error {
	b, err := json.Marshal(refRecord{Reference: ref.String(), Path: cleanPath(path), Digest: digest})
	if err != nil {
		return err
	}
	return writeAtomic(p.refPath(ref, path), b, 0o644)
}

func writeAtomic(path string, b []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("containerdisk cache: %w", err)
	}
	_, werr := tmp.Write(b)
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr, os.Chmod(tmp.Name(), mode)); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("containerdisk cache: write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("containerdisk cache: %w", err)
	}
	return nil
}

// download imports the image pinned by src.URL into a temporary directory
// and renames it into place when complete.
func (p *Puller) download(ctx context.Context, ref Reference, digest, path string, src *importer.RegistrySource) (Image, error) {
	tmp, err := os.MkdirTemp(p.sub(tmpDir), "pull-")
	if err != nil {
		return Image{}, &importer.Error{Reason: importer.ReasonDestination, Err: fmt.Errorf("containerdisk cache: %w", err)}
	}
	defer os.RemoveAll(tmp)
	disk := filepath.Join(tmp, diskFile)
	res, err := importer.Import(ctx, importer.Request{
		Source:   importer.Source{Registry: src},
		Dest:     disk,
		Capacity: p.cfg.MaxImageSize,
		WorkDir:  tmp,
		Logger:   p.log.With("image", ref.String()),
	})
	if err != nil {
		return Image{}, err
	}
	rec := entryRecord{Reference: ref.String(), Digest: digest, Path: cleanPath(path), VirtualSize: res.VirtualSize, Pulled: time.Now().UTC()}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return Image{}, err
	}
	err = errors.Join(
		os.Chmod(disk, 0o644),
		os.WriteFile(filepath.Join(tmp, entryFile), b, 0o644),
		os.Mkdir(filepath.Join(tmp, usersDir), 0o755),
		os.Chmod(tmp, 0o755),
	)
	if err != nil {
		return Image{}, &importer.Error{Reason: importer.ReasonDestination, Err: fmt.Errorf("containerdisk cache: %w", err)}
	}
	name := entryName(digest, path)
	p.mu.Lock()
	defer p.mu.Unlock()
	final := p.sub(imagesDir, name)
	if e, err := p.readEntry(name); err == nil {
		return e.img, nil // made meanwhile under another name's pull
	}
	os.RemoveAll(final) // an incomplete leftover
	if err := os.Rename(tmp, final); err != nil {
		return Image{}, &importer.Error{Reason: importer.ReasonDestination, Err: fmt.Errorf("containerdisk cache: %w", err)}
	}
	e, err := p.readEntry(name)
	if err != nil {
		return Image{}, &importer.Error{Reason: importer.ReasonDestination, Err: fmt.Errorf("containerdisk cache: %w", err)}
	}
	return e.img, nil
}

// addUser records owner as a user of img; the caller holds p.mu.
func (p *Puller) addUser(img Image, owner string) error {
	users := filepath.Join(filepath.Dir(img.Path), usersDir)
	if _, err := os.Stat(img.Path); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(users, owner), os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	return f.Close()
}

// removeUser forgets owner everywhere; the caller holds p.mu.
func (p *Puller) removeUser(owner string) error {
	if owner == "" || strings.ContainsAny(owner, "/\x00") || owner == "." || owner == ".." {
		return fmt.Errorf("containerdisk: invalid owner %q", owner)
	}
	ents, err := os.ReadDir(p.sub(imagesDir))
	if err != nil {
		return fmt.Errorf("containerdisk cache: %w", err)
	}
	var errs []error
	for _, d := range ents {
		err := os.Remove(p.sub(imagesDir, d.Name(), usersDir, owner))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	for _, ks := range p.keys {
		delete(ks.results, owner)
		delete(ks.waiting, owner)
	}
	return errors.Join(errs...)
}

// prune removes images without users whose last user left (or that were
// pulled) more than KeepUnused ago; the caller holds p.mu. An image is
// renamed into tmp before it is removed, so it is never seen half gone.
func (p *Puller) prune() error {
	ents, err := p.entries()
	var errs []error
	errs = append(errs, err)
	for _, e := range ents {
		users, err := e.users()
		if err != nil || len(users) > 0 {
			errs = append(errs, err)
			continue
		}
		st, err := os.Stat(filepath.Join(e.dir, usersDir))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if p.cfg.KeepUnused > 0 && time.Since(st.ModTime()) < p.cfg.KeepUnused {
			continue
		}
		gone := filepath.Join(p.sub(tmpDir), "gc-"+filepath.Base(e.dir))
		if err := os.Rename(e.dir, gone); err != nil {
			errs = append(errs, fmt.Errorf("containerdisk cache: %w", err))
			continue
		}
		errs = append(errs, os.RemoveAll(gone))
		p.log.Info("removed unused containerDisk image", "image", e.rec.Reference, "digest", e.rec.Digest)
	}
	return errors.Join(errs...)
}
