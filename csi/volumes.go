package csi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Volume sizes are whole MiB; an ext4 filesystem needs a few MiB to exist.
const (
	sizeUnit         = 1 << 20
	minBlockBytes    = 1 << 20
	minFilesystemFS  = 8 << 20
	supportedFSType  = "ext4"
	mountFlagsAccept = "ro, nodev, noexec, nosuid, noatime, nodiratime, relatime"
)

func minVolumeBytes(block bool) int64 {
	if block {
		return minBlockBytes
	}
	return minFilesystemFS
}

// mountFlagBits maps the mount flags a publish may ask for to their bits.
var mountFlagBits = map[string]uintptr{
	"ro":         unix.MS_RDONLY,
	"nodev":      unix.MS_NODEV,
	"noexec":     unix.MS_NOEXEC,
	"nosuid":     unix.MS_NOSUID,
	"noatime":    unix.MS_NOATIME,
	"nodiratime": unix.MS_NODIRATIME,
	"relatime":   unix.MS_RELATIME,
	"rw":         0,
	"defaults":   0,
}

// checkCapabilities validates capabilities and reports whether they ask for
// a block volume. Only single-node access modes are served; a request may
// not mix block and mount access.
func checkCapabilities(caps []*csi.VolumeCapability) (block bool, err error) {
	if len(caps) == 0 {
		return false, status.Error(codes.InvalidArgument, "volume capabilities are required")
	}
	var sawBlock, sawMount bool
	for _, c := range caps {
		if c == nil {
			return false, status.Error(codes.InvalidArgument, "volume capability is empty")
		}
		switch c.GetAccessMode().GetMode() {
		case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		case csi.VolumeCapability_AccessMode_UNKNOWN:
			return false, status.Error(codes.InvalidArgument, "volume capability has no access mode")
		default:
			return false, status.Errorf(codes.InvalidArgument, "access mode %s is not supported: volumes are local to one node", c.GetAccessMode().GetMode())
		}
		switch {
		case c.GetBlock() != nil:
			sawBlock = true
		case c.GetMount() != nil:
			sawMount = true
			if fs := c.GetMount().GetFsType(); fs != "" && fs != supportedFSType {
				return false, status.Errorf(codes.InvalidArgument, "filesystem type %q is not supported (only %s)", fs, supportedFSType)
			}
			if _, err := mountFlags(c.GetMount().GetMountFlags()); err != nil {
				return false, err
			}
		default:
			return false, status.Error(codes.InvalidArgument, "volume capability has no access type")
		}
	}
	if sawBlock && sawMount {
		return false, status.Error(codes.InvalidArgument, "a volume is either block or mount, not both")
	}
	return sawBlock, nil
}

// mountFlags turns mount flags into bits; unknown flags are refused rather
// than ignored.
func mountFlags(flags []string) (uintptr, error) {
	var bits uintptr
	for _, f := range flags {
		b, ok := mountFlagBits[strings.TrimSpace(f)]
		if !ok {
			return 0, status.Errorf(codes.InvalidArgument, "mount flag %q is not supported (supported: %s)", f, mountFlagsAccept)
		}
		bits |= b
	}
	return bits, nil
}

// volumeSize turns a capacity range into whole MiB, def when it asks for
// nothing.
func volumeSize(cr *csi.CapacityRange, def int64, block bool) (int64, error) {
	required, limit := cr.GetRequiredBytes(), cr.GetLimitBytes()
	if required < 0 || limit < 0 {
		return 0, status.Error(codes.InvalidArgument, "capacity range is negative")
	}
	if limit > 0 && required > limit {
		return 0, status.Errorf(codes.InvalidArgument, "required %d bytes exceeds the limit %d", required, limit)
	}
	size := required
	if size == 0 {
		size = def
		if limit > 0 && size > limit {
			size = limit
		}
	}
	size = max(size, minVolumeBytes(block))
	size = (size + sizeUnit - 1) / sizeUnit * sizeUnit
	if limit > 0 && size > limit {
		return 0, status.Errorf(codes.OutOfRange, "no volume size fits between %d and %d bytes (sizes are whole MiB, at least %d)", required, limit, minVolumeBytes(block))
	}
	return size, nil
}

// fitsRange reports whether an existing volume satisfies cr.
func fitsRange(capacity int64, cr *csi.CapacityRange) bool {
	if r := cr.GetRequiredBytes(); r > 0 && capacity < r {
		return false
	}
	if l := cr.GetLimitBytes(); l > 0 && capacity > l {
		return false
	}
	return true
}

// source is a resolved volume content source, locked until unlock.
type source struct {
	volumeID   string
	snapshotID string
	size       int64
	image      string  // snapshot image
	vol        *volume // source volume
	pool       *pool   // source volume's pool
	unlock     func()
}

func (d *Driver) contentSource(cs *csi.VolumeContentSource, block bool) (source, error) {
	switch {
	case cs == nil:
		return source{}, nil
	case cs.GetSnapshot() != nil:
		id := cs.GetSnapshot().GetSnapshotId()
		if err := checkID("source snapshot", id); err != nil {
			return source{}, err
		}
		unlock := d.locks.lock("snapshot/" + id)
		d.mu.Lock()
		s, ok := d.snapshots[id]
		var c snapshot
		if ok {
			c = *s
		}
		d.mu.Unlock()
		if !ok {
			unlock()
			return source{}, status.Errorf(codes.NotFound, "source snapshot %s does not exist", id)
		}
		if c.Block != block {
			unlock()
			return source{}, status.Error(codes.InvalidArgument, "source snapshot's access type differs from the requested one")
		}
		return source{snapshotID: id, size: c.SizeBytes, image: d.pool(c.Pool).snapImage(id), unlock: unlock}, nil
	case cs.GetVolume() != nil:
		id := cs.GetVolume().GetVolumeId()
		if err := checkID("source volume", id); err != nil {
			return source{}, err
		}
		unlock := d.locks.lock("volume/" + id)
		v, err := d.volumeRecord(id)
		if err != nil {
			unlock()
			return source{}, err
		}
		if v.Block != block {
			unlock()
			return source{}, status.Error(codes.InvalidArgument, "source volume's access type differs from the requested one")
		}
		return source{volumeID: id, size: v.CapacityBytes, vol: &v, pool: d.pool(v.Pool), unlock: unlock}, nil
	default:
		return source{}, status.Error(codes.InvalidArgument, "volume content source has no snapshot or volume")
	}
}

// buildVolume makes v's image (empty, or a copy of src), formats or grows
// it, and mounts or attaches it. On failure nothing is left behind.
func (d *Driver) buildVolume(ctx context.Context, p *pool, v *volume, src source) error {
	img := p.image(v.ID)
	var err error
	switch {
	case src.snapshotID != "":
		err = copySparse(src.image, img)
	case src.volumeID != "":
		err = d.copyVolumeImage(src.pool, src.vol, img)
	default:
		err = createSparse(img, v.CapacityBytes)
	}
	if err != nil {
		_ = os.Remove(img)
		return status.Errorf(codes.Internal, "create volume image: %v", err)
	}
	fail := func(err error) error {
		if terr := d.teardownVolume(p, v); terr != nil {
			d.log.Error("undo volume", "volume", v.ID, "err", terr)
		}
		return status.Errorf(codes.Internal, "build volume %s: %v", v.ID, err)
	}
	grown := src.size > 0 && v.CapacityBytes > src.size
	if grown {
		if err := os.Truncate(img, v.CapacityBytes); err != nil {
			return fail(fmt.Errorf("grow image: %w", err))
		}
	}
	switch {
	case v.Block:
	case src.size == 0:
		if err := makeExt4(ctx, img); err != nil {
			return fail(err)
		}
	default:
		// A copy may be larger than its source, or come from a volume
		// whose filesystem still awaits growing.
		if err := growExt4Offline(ctx, img); err != nil {
			return fail(err)
		}
	}
	v.FilesystemBytes = v.CapacityBytes
	if v.Block {
		v.FilesystemBytes = 0
		dev, err := attachLoop(img, false)
		if err != nil {
			return fail(err)
		}
		v.dev = dev
		return nil
	}
	if err := mountImage(img, p.mountDir(v.ID)); err != nil {
		return fail(err)
	}
	return nil
}

// deactivate unmounts or detaches a volume; a filesystem still in use is
// FailedPrecondition.
func (d *Driver) deactivate(p *pool, v *volume) error {
	if v.Block {
		if v.dev != "" && loopBacking(v.dev) == p.image(v.ID) {
			if err := detachLoop(v.dev); err != nil {
				return status.Errorf(codes.Internal, "volume %s: %v", v.ID, err)
			}
		}
		v.dev = ""
		return nil
	}
	if err := unmountIfMounted(p.mountDir(v.ID)); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return status.Errorf(codes.FailedPrecondition, "volume %s is in use: %v", v.ID, err)
		}
		return status.Errorf(codes.Internal, "volume %s: %v", v.ID, err)
	}
	return nil
}

// teardownVolume deactivates v and removes its files.
func (d *Driver) teardownVolume(p *pool, v *volume) error {
	if err := d.deactivate(p, v); err != nil {
		return err
	}
	if err := os.RemoveAll(p.mountDir(v.ID)); err != nil {
		return fmt.Errorf("remove mount point: %w", err)
	}
	if err := os.Remove(p.image(v.ID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove image: %w", err)
	}
	return nil
}

// errNeedsOnlineResize says a published filesystem can only grow online,
// which this process may not do.
var errNeedsOnlineResize = errors.New("the filesystem is in use and online resizing needs CAP_SYS_RESOURCE")

// growVolume grows v's image and loop devices to size. The caller then
// grows a filesystem with growFilesystem.
func (d *Driver) growVolume(p *pool, v *volume, size int64) error {
	if err := os.Truncate(p.image(v.ID), size); err != nil {
		return status.Errorf(codes.Internal, "grow volume %s: %v", v.ID, err)
	}
	var devs []string
	if v.Block {
		devs = append(devs, v.dev)
		for _, pub := range v.Published {
			devs = append(devs, pub.Device)
		}
	} else if dev, err := loopDeviceOf(p.mountDir(v.ID)); err == nil {
		devs = append(devs, dev)
	}
	for _, dev := range devs {
		if dev == "" {
			continue
		}
		if err := refreshLoopCapacity(dev); err != nil {
			return status.Errorf(codes.Internal, "grow volume %s: %v", v.ID, err)
		}
	}
	return nil
}

// growFilesystem grows a filesystem volume's ext4 to fill its image:
// online when allowed, otherwise unmounted for a moment, which works only
// while nothing uses it. It returns errNeedsOnlineResize when neither way
// is open.
func (d *Driver) growFilesystem(ctx context.Context, p *pool, v *volume) error {
	dir := p.mountDir(v.ID)
	if d.onlineResize {
		dev, err := loopDeviceOf(dir)
		if err != nil {
			return err
		}
		if err := refreshLoopCapacity(dev); err != nil {
			return err
		}
		return growExt4Online(ctx, dev)
	}
	if len(v.Published) > 0 {
		return errNeedsOnlineResize
	}
	if err := unmountIfMounted(dir); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return errNeedsOnlineResize
		}
		return err
	}
	err := growExt4Offline(ctx, p.image(v.ID))
	if merr := mountImage(p.image(v.ID), dir); merr != nil && err == nil {
		err = merr
	}
	return err
}

// copyVolumeImage copies v's image to dst; a mounted filesystem is frozen
// during the copy so the copy is consistent.
func (d *Driver) copyVolumeImage(p *pool, v *volume, dst string) error {
	img := p.image(v.ID)
	if !v.Block {
		dir := p.mountDir(v.ID)
		if mounted, err := isMountpoint(dir); err == nil && mounted {
			return withFrozen(dir, func() error { return copySparse(img, dst) })
		}
	}
	return copySparse(img, dst)
}

// poolSpace is the free space of the filesystem holding path.
func poolSpace(path string) (int64, error) {
	free, _, err := poolUsage(path)
	return free, err
}

// poolUsage is the free and total space of the filesystem holding path.
func poolUsage(path string) (free, total int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, 0, fmt.Errorf("statfs %s: %w", path, err)
	}
	return int64(st.Bavail) * st.Bsize, int64(st.Blocks) * st.Bsize, nil
}

// poolCapacity is what new volumes may still take from p: the free space
// less what the existing (sparse) volumes may still write, so a volume's
// size is never promised twice.
func (d *Driver) poolCapacity(p *pool) int64 {
	free, err := poolSpace(p.path)
	if err != nil {
		d.log.Error("pool space", "pool", p.name, "err", err)
		return 0
	}
	type owed struct {
		image    string
		capacity int64
	}
	var vols []owed
	d.mu.Lock()
	for _, v := range d.volumes {
		if v.Pool == p.name {
			vols = append(vols, owed{p.image(v.ID), v.CapacityBytes})
		}
	}
	d.mu.Unlock()
	for _, o := range vols {
		if rest := o.capacity - allocatedBytes(o.image); rest > 0 {
			free -= rest
		}
	}
	return max(free, 0)
}

// loopBacking returns the backing file of loop device dev, "" if none.
func loopBacking(dev string) string {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)")
}
