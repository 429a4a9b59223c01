package csi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Filesystem freeze ioctls (_IOWR('X', 119/120, int)).
const (
	ioctlFIFREEZE = 0xC0045877
	ioctlFITHAW   = 0xC0045878
)

// isMountpoint reports whether path is the root of a mount (bind mounts of
// single files included).
func isMountpoint(path string) (bool, error) {
	var stx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("statx %s: %w", path, err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, fmt.Errorf("statx %s: kernel does not report mount roots", path)
	}
	return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
}

// unmountIfMounted unmounts path when it is a mount root; EINVAL (not
// mounted) is success.
func unmountIfMounted(path string) error {
	mounted, err := isMountpoint(path)
	if err != nil || !mounted {
		return err
	}
	if err := unix.Unmount(path, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unmount %s: %w", path, err)
	}
	return nil
}

// makeShared makes dir a mount point of its own (a recursive bind onto
// itself, carrying any volume already mounted below it, unless it already
// is one) and gives it and the mounts below it shared propagation.
// QEMU runs in a mount namespace libvirt makes a recursive slave of the
// host's when the guest starts; a mount made later under a shared mount
// reaches it, under a private one (a host whose / is not shared) it does
// not. Calling it again changes nothing.
func makeShared(dir string) error {
	mounted, err := isMountpoint(dir)
	if err != nil {
		return err
	}
	if !mounted {
		if err := unix.Mount(dir, dir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s onto itself: %w", dir, err)
		}
	}
	if err := unix.Mount("", dir, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", dir, err)
	}
	return nil
}

// mountExt4 mounts the ext4 filesystem on dev at dir.
func mountExt4(dev, dir string) error {
	if err := unix.Mount(dev, dir, "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount %s on %s: %w", dev, dir, err)
	}
	return nil
}

// bindMount binds source onto target and applies flags (MS_RDONLY, MS_NOEXEC,
// ...) with a remount, since a bind ignores them on the first call.
func bindMount(source, target string, flags uintptr) error {
	if err := unix.Mount(source, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", source, target, err)
	}
	if flags == 0 {
		return nil
	}
	if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|flags, ""); err != nil {
		_ = unix.Unmount(target, 0)
		return fmt.Errorf("remount %s with flags %#x: %w", target, flags, err)
	}
	return nil
}

// runTool runs an external program and folds its output into the error.
func runTool(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %v: %w: %s", name, args, err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// makeExt4 formats image (a regular file) as ext4 with no blocks reserved
// for root, so the whole requested size is the user's.
func makeExt4(ctx context.Context, image string) error {
	return runTool(ctx, "mkfs.ext4", "-q", "-F", "-m", "0",
		"-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", image)
}

// growExt4Online grows the mounted ext4 filesystem on dev to fill it. The
// kernel asks for CAP_SYS_RESOURCE.
func growExt4Online(ctx context.Context, dev string) error {
	return runTool(ctx, "resize2fs", dev)
}

// growExt4Offline checks and grows the unmounted ext4 filesystem in image
// to fill it; it needs no special capability.
func growExt4Offline(ctx context.Context, image string) error {
	// e2fsck -p exits 1 when it corrected something, which is fine.
	if err := runTool(ctx, "e2fsck", "-f", "-p", image); err != nil {
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 {
			return err
		}
	}
	return runTool(ctx, "resize2fs", image)
}

// canResizeOnline reports whether this process holds CAP_SYS_RESOURCE,
// which online ext4 resizing needs.
func canResizeOnline() bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			return err == nil && caps&(1<<unix.CAP_SYS_RESOURCE) != 0
		}
	}
	return false
}

// createSparse creates path as a sparse file of size bytes; it fails if path
// exists.
func createSparse(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create %s: %w", path, err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("size %s: %w", path, err)
	}
	return nil
}

// copySparse copies src to a new file dst, keeping holes, using
// copy_file_range for the data extents.
func copySparse(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("open %s: %w", src, err)
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", src, err)
	}
	out, err := os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create %s: %w", dst, err)
	}
	defer func() {
		if cerr := out.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("close %s: %w", dst, cerr)
		}
		if err != nil {
			os.Remove(dst)
		}
	}()
	size := st.Size()
	if err := out.Truncate(size); err != nil {
		return fmt.Errorf("size %s: %w", dst, err)
	}
	inFd, outFd := int(in.Fd()), int(out.Fd())
	var pos int64
	for pos < size {
		start, err := unix.Seek(inFd, pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole remains
		}
		if err != nil {
			return fmt.Errorf("seek data in %s: %w", src, err)
		}
		end, err := unix.Seek(inFd, start, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole in %s: %w", src, err)
		}
		if err := copyRange(inFd, outFd, start, end-start); err != nil {
			return fmt.Errorf("copy %s to %s: %w", src, dst, err)
		}
		pos = end
	}
	if err := out.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dst, err)
	}
	return nil
}

func copyRange(inFd, outFd int, off, n int64) error {
	inOff, outOff := off, off
	for n > 0 {
		chunk := n
		if chunk > 1<<30 {
			chunk = 1 << 30
		}
		w, err := unix.CopyFileRange(inFd, &inOff, outFd, &outOff, int(chunk), 0)
		if err != nil {
			return err
		}
		if w == 0 {
			return io.ErrUnexpectedEOF
		}
		n -= int64(w)
	}
	return nil
}

// withFrozen runs fn while the filesystem mounted at dir is frozen, so a
// copy of its image is consistent.
func withFrozen(dir string, fn func() error) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), ioctlFIFREEZE, 0); err != nil {
		return fmt.Errorf("freeze %s: %w", dir, err)
	}
	ferr := fn()
	if err := unix.IoctlSetInt(int(f.Fd()), ioctlFITHAW, 0); err != nil && ferr == nil {
		ferr = fmt.Errorf("thaw %s: %w", dir, err)
	}
	return ferr
}

// allocatedBytes is the space path really occupies on its filesystem.
func allocatedBytes(path string) int64 {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0
	}
	return st.Blocks * 512
}

// writeFileAtomic replaces path with data: a synced temporary file renamed
// over it, then the directory synced.
func writeFileAtomic(path string, data []byte) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("create temporary state file: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("sync %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("rename state file: %w", err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}
