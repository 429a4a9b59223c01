package csi

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"
)

// stateFileName is the per-pool record of volumes and snapshots.
const stateFileName = "csi-state.json"

// stateVersion is bumped when the state file changes shape.
const stateVersion = 1

// idPattern is what volume, snapshot and pool IDs may look like: no path
// separators, no leading dot, bounded length.
var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

func validID(id string) bool { return idPattern.MatchString(id) }

// newID returns a fresh random identifier.
func newID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return hex.EncodeToString(b[:])
}

// volume is the record of one volume.
type volume struct {
	ID               string                 `json:"id"`
	Name             string                 `json:"name"`
	Pool             string                 `json:"pool"`
	CapacityBytes    int64                  `json:"capacityBytes"`
	FilesystemBytes  int64                  `json:"filesystemBytes,omitempty"`
	Block            bool                   `json:"block,omitempty"`
	SourceVolumeID   string                 `json:"sourceVolumeID,omitempty"`
	SourceSnapshotID string                 `json:"sourceSnapshotID,omitempty"`
	CreatedAt        time.Time              `json:"createdAt"`
	Published        map[string]publication `json:"published,omitempty"`

	// dev is the read-write loop device of a block volume, found again at
	// start-up.
	dev string
}

// publication is one NodePublishVolume target.
type publication struct {
	ReadOnly bool `json:"readOnly,omitempty"`
	// SingleWriter is set when published with SINGLE_NODE_SINGLE_WRITER.
	SingleWriter bool `json:"singleWriter,omitempty"`
	// Device is the read-only loop device made for a read-only block target.
	Device string `json:"device,omitempty"`
}

func (v *volume) clone() volume {
	c := *v
	c.Published = maps.Clone(v.Published)
	return c
}

// snapshot is the record of one snapshot: a full copy of the source image.
type snapshot struct {
	ID             string    `json:"id"`
	Name           string    `json:"name"`
	Pool           string    `json:"pool"`
	SourceVolumeID string    `json:"sourceVolumeID"`
	SizeBytes      int64     `json:"sizeBytes"`
	Block          bool      `json:"block,omitempty"`
	CreatedAt      time.Time `json:"createdAt"`
}

type poolFile struct {
	Version   int         `json:"version"`
	Volumes   []*volume   `json:"volumes"`
	Snapshots []*snapshot `json:"snapshots"`
}

// pool is one storage pool directory:
//
//	<path>/csi-state.json     the records
//	<path>/volumes/<id>.img   a volume's image
//	<path>/volumes/<id>/      a filesystem volume's mount point
//	<path>/snapshots/<id>.img a snapshot's image
type pool struct {
	name string
	path string
}

func openPool(pc PoolConfig, share bool) (*pool, error) {
	// Directories are traversable by everyone (not listable): QEMU runs as
	// its own user and must reach a VM's disk.img by its path.
	for _, dir := range []string{pc.Path, filepath.Join(pc.Path, "volumes"), filepath.Join(pc.Path, "snapshots")} {
		if err := os.MkdirAll(dir, 0o711); err != nil {
			return nil, fmt.Errorf("pool %s: %w", pc.Name, err)
		}
	}
	// Loop devices report their backing file by its resolved path.
	real, err := filepath.EvalSymlinks(pc.Path)
	if err != nil {
		return nil, fmt.Errorf("pool %s: %w", pc.Name, err)
	}
	if share {
		if err := makeShared(filepath.Join(real, "volumes")); err != nil {
			return nil, fmt.Errorf("pool %s: %w", pc.Name, err)
		}
	}
	return &pool{name: pc.Name, path: real}, nil
}

func (p *pool) statePath() string          { return filepath.Join(p.path, stateFileName) }
func (p *pool) image(id string) string     { return filepath.Join(p.path, "volumes", id+".img") }
func (p *pool) mountDir(id string) string  { return filepath.Join(p.path, "volumes", id) }
func (p *pool) snapImage(id string) string { return filepath.Join(p.path, "snapshots", id+".img") }

func (p *pool) read() (*poolFile, error) {
	b, err := os.ReadFile(p.statePath())
	if errors.Is(err, os.ErrNotExist) {
		return &poolFile{Version: stateVersion}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("pool %s: read state: %w", p.name, err)
	}
	var f poolFile
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("pool %s: parse state: %w", p.name, err)
	}
	if f.Version != stateVersion {
		return nil, fmt.Errorf("pool %s: state version %d, want %d", p.name, f.Version, stateVersion)
	}
	return &f, nil
}

// savePool writes the records of pool name. Callers hold d.mu.
func (d *Driver) savePool(name string) error {
	f := poolFile{Version: stateVersion, Volumes: []*volume{}, Snapshots: []*snapshot{}}
	for _, v := range d.volumes {
		if v.Pool == name {
			f.Volumes = append(f.Volumes, v)
		}
	}
	for _, s := range d.snapshots {
		if s.Pool == name {
			f.Snapshots = append(f.Snapshots, s)
		}
	}
	sort.Slice(f.Volumes, func(i, j int) bool { return f.Volumes[i].ID < f.Volumes[j].ID })
	sort.Slice(f.Snapshots, func(i, j int) bool { return f.Snapshots[i].ID < f.Snapshots[j].ID })
	b, err := json.MarshalIndent(&f, "", " ")
	if err != nil {
		return fmt.Errorf("pool %s: encode state: %w", name, err)
	}
	p := d.pool(name)
	if p == nil {
		return fmt.Errorf("pool %s is not served", name)
	}
	if err := writeFileAtomic(p.statePath(), b); err != nil {
		return fmt.Errorf("pool %s: %w", name, err)
	}
	return nil
}

// load reads every pool's records, removes leftovers of interrupted
// operations and brings the volumes back.
func (d *Driver) load() error {
	loops, err := loopsByBacking()
	if err != nil {
		return err
	}
	for _, p := range d.poolList() {
		if err := d.loadPool(p, loops); err != nil {
			return err
		}
	}
	return nil
}

// loadPool reads one pool's records, removes its leftovers, brings its
// volumes back and rewrites its state. Callers serve p already.
func (d *Driver) loadPool(p *pool, loops map[string][]loopDevice) error {
	f, err := p.read()
	if err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	// Check every record before taking any, so a refused pool leaves the
	// driver as it was.
	names, snapNames := map[string]bool{}, map[string]bool{}
	for _, v := range f.Volumes {
		if !validID(v.ID) || v.Pool != p.name {
			return fmt.Errorf("pool %s: state holds bad volume record %q", p.name, v.ID)
		}
		if _, dup := d.volumeNames[v.Name]; dup || names[v.Name] {
			return fmt.Errorf("pool %s: volume name %q recorded twice", p.name, v.Name)
		}
		if _, dup := d.volumes[v.ID]; dup {
			return fmt.Errorf("pool %s: volume %q is recorded in another pool too", p.name, v.ID)
		}
		names[v.Name] = true
	}
	for _, s := range f.Snapshots {
		if !validID(s.ID) || s.Pool != p.name {
			return fmt.Errorf("pool %s: state holds bad snapshot record %q", p.name, s.ID)
		}
		if _, dup := d.snapshotNames[s.Name]; dup || snapNames[s.Name] {
			return fmt.Errorf("pool %s: snapshot name %q recorded twice", p.name, s.Name)
		}
		snapNames[s.Name] = true
	}
	for _, v := range f.Volumes {
		d.volumes[v.ID] = v
		d.volumeNames[v.Name] = v.ID
	}
	for _, s := range f.Snapshots {
		d.snapshots[s.ID] = s
		d.snapshotNames[s.Name] = s.ID
	}
	d.removeLeftovers(p, loops)
	for _, v := range f.Volumes {
		if err := d.activate(v, p, loops); err != nil {
			// The record stays: the volume reports an abnormal condition
			// and can still be deleted.
			d.log.Error("bring volume back", "volume", v.ID, "pool", p.name, "err", err)
		}
		d.reconcilePublications(v, loops[p.image(v.ID)])
	}
	return d.savePool(p.name)
}

// removeLeftovers deletes images and mount points that no record owns:
// what a crash between building a volume and recording it (or between
// forgetting it and removing it) leaves behind.
func (d *Driver) removeLeftovers(p *pool, loops map[string][]loopDevice) {
	entries, _ := os.ReadDir(filepath.Join(p.path, "volumes"))
	for _, e := range entries {
		id := strings.TrimSuffix(e.Name(), ".img")
		if _, known := d.volumes[id]; known || !validID(id) {
			continue
		}
		path := filepath.Join(p.path, "volumes", e.Name())
		if e.IsDir() {
			if err := unmountIfMounted(path); err != nil {
				d.log.Warn("leftover mount", "path", path, "err", err)
				continue
			}
		} else {
			for _, l := range loops[path] {
				_ = detachLoop(l.Path)
			}
		}
		d.log.Info("removing leftover", "pool", p.name, "path", path)
		_ = os.RemoveAll(path)
	}
	entries, _ = os.ReadDir(filepath.Join(p.path, "snapshots"))
	for _, e := range entries {
		id := strings.TrimSuffix(e.Name(), ".img")
		if _, known := d.snapshots[id]; known {
			continue
		}
		path := filepath.Join(p.path, "snapshots", e.Name())
		d.log.Info("removing leftover", "pool", p.name, "path", path)
		_ = os.RemoveAll(path)
	}
}

// activate makes a recorded volume usable: its filesystem mounted at the
// mount point, or its block image attached to a loop device.
func (d *Driver) activate(v *volume, p *pool, loops map[string][]loopDevice) error {
	img := p.image(v.ID)
	if _, err := os.Stat(img); err != nil {
		return fmt.Errorf("volume image: %w", err)
	}
	if v.Block {
		for _, l := range loops[img] {
			if !l.ReadOnly {
				v.dev = l.Path
				return nil
			}
		}
		dev, err := attachLoop(img, false)
		if err != nil {
			return err
		}
		v.dev = dev
		return nil
	}
	return mountImage(img, p.mountDir(v.ID))
}

// mountImage loop-mounts the ext4 image at dir unless it already is.
func mountImage(img, dir string) error {
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return fmt.Errorf("create mount point: %w", err)
	}
	mounted, err := isMountpoint(dir)
	if err != nil || mounted {
		return err
	}
	// Autoclear: the device goes away with the last unmount. It is held
	// open until the mount holds it.
	dev, err := openLoop(img, false, true)
	if err != nil {
		return err
	}
	defer dev.Close()
	return mountExt4(dev.Name(), dir)
}

// reconcilePublications forgets targets that are no longer mounted (after
// a node reboot the CO publishes again). A read-only loop device is
// detached only if it still serves this volume's image.
func (d *Driver) reconcilePublications(v *volume, imageLoops []loopDevice) {
	for target, pub := range v.Published {
		mounted, err := isMountpoint(target)
		if err == nil && mounted {
			continue
		}
		for _, l := range imageLoops {
			if pub.Device != "" && l.Path == pub.Device {
				_ = detachLoop(l.Path)
			}
		}
		delete(v.Published, target)
	}
}
