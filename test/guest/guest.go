// Package guest builds small bootable test guests from Debian packages and
// boots them under QEMU.
//
// Nothing is downloaded except through apt: the kernel is the package that
// linux-image-cloud-amd64 depends on (fetched with `apt-get download` and
// unpacked with `dpkg -x`), the userland is busybox-static, the bootloader is
// extlinux. Every artefact is cached under CacheDir, keyed by a hash of its
// inputs, so it is rebuilt only when an input changes; builds hold a file lock,
// so two test processes may ask for the same artefact at once.
//
// The default guest (an empty Spec) prints these lines on its console, which
// tests wait for with Instance.Expect:
//
//	NODEVIRT-GUEST-BOOTED
//	NODEVIRT-NIC eth0 52:54:00:12:34:56          one per network interface
//	NODEVIRT-DISK vda 67108864                   one per block device, size in bytes
//	NODEVIRT-SEED sr0 cidata                     a NoCloud or config-drive seed was found
//	NODEVIRT-USERDATA-BEGIN / ... / NODEVIRT-USERDATA-END
//	NODEVIRT-USERDATA-EXIT 0                     user-data started with #! and was run
//	NODEVIRT-IP eth0 10.0.0.2/24                 from nodevirt.ip= on the cmdline or in user-data
//	NODEVIRT-AGENT-STARTED /dev/virtio-ports/org.qemu.guest_agent.0   Spec.GuestAgent
//	NODEVIRT-INIT-EXIT 0                         Spec.Init was run
//	NODEVIRT-GUEST-READY                         the root shell on the console follows
//	NODEVIRT-GUEST-POWEROFF                      the guest is shutting down
//
// The guest powers off when it sees the ACPI power button (QEMU's
// system_powerdown, libvirt's shutdown), through busybox acpid.
//
// The cloud kernel has virtio (blk, net, scsi, console) and IDE (ata_piix)
// drivers but no AHCI: on a q35 machine put CD-ROMs (seeds) on virtio-scsi
// or attach the seed as a virtio disk; SATA devices stay invisible.
package guest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// CacheEnv names the environment variable that overrides DefaultCacheDir.
const CacheEnv = "NODEVIRT_GUEST_CACHE"

// DefaultCacheDir is where artefacts are kept unless CacheEnv says otherwise.
const DefaultCacheDir = "/var/cache/nodevirt/guest"

// builderVersion is part of every cache key: bump it when the way an artefact
// is made changes, so stale artefacts are not reused.
const builderVersion = "nodevirt-guest/1"

// CacheDir returns the directory that holds the built artefacts.
func CacheDir() string {
	if d := os.Getenv(CacheEnv); d != "" {
		return d
	}
	return DefaultCacheDir
}

// requirement is a host file the builder needs and the Debian package that
// provides it.
type requirement struct {
	path    string // absolute path, or a command name looked up on PATH
	pkg     string
	purpose string
}

var requirements = []requirement{
	{"apt-get", "apt", "kernel download"},
	{"apt-cache", "apt", "kernel download"},
	{"dpkg", "dpkg", "kernel unpacking"},
	{"/bin/busybox", "busybox-static", "initramfs"},
	{"ldd", "libc-bin", "initramfs extra files"},
	{"mkfs.ext2", "e2fsprogs", "boot disk"},
	{"losetup", "mount", "boot disk"},
	{"mount", "mount", "boot disk"},
	{"umount", "mount", "boot disk"},
	{"extlinux", "extlinux", "boot disk"},
	{"/usr/lib/syslinux/mbr/mbr.bin", "syslinux-common", "boot disk"},
	{"genisoimage", "genisoimage", "cloud-init seeds"},
	{"qemu-img", "qemu-utils", "qcow2 images"},
	{"qemu-system-x86_64", "qemu-system-x86", "running guests"},
	{"nsenter", "util-linux", "guests in a network namespace"},
	{"/usr/sbin/qemu-ga", "qemu-guest-agent", "guests with a guest agent"},
}

// Requirements lists the Debian packages this package needs on the host, for
// a Makefile to install. The package itself never installs anything.
func Requirements() []string {
	seen := map[string]bool{}
	var pkgs []string
	for _, r := range requirements {
		if !seen[r.pkg] {
			seen[r.pkg] = true
			pkgs = append(pkgs, r.pkg)
		}
	}
	return pkgs
}

// need returns the path of a required tool or file, or an error naming the
// Debian package to install.
func need(name string) (string, error) {
	for _, r := range requirements {
		if r.path != name {
			continue
		}
		if filepath.IsAbs(name) {
			if _, err := os.Stat(name); err != nil {
				return "", fmt.Errorf("%s needs %s: install Debian package %s", r.purpose, name, r.pkg)
			}
			return name, nil
		}
		p, err := exec.LookPath(name)
		if err != nil {
			// sbin directories are not always on a test's PATH.
			for _, dir := range []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"} {
				if st, serr := os.Stat(filepath.Join(dir, name)); serr == nil && !st.IsDir() {
					return filepath.Join(dir, name), nil
				}
			}
			return "", fmt.Errorf("%s needs %s: install Debian package %s", r.purpose, name, r.pkg)
		}
		return p, nil
	}
	panic("guest: unlisted requirement " + name)
}

// run runs a command and returns its stdout; a failure carries stderr.
func run(ctx context.Context, dir string, name string, args ...string) (string, error) {
	path, err := need(name)
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Dir = dir
	var stdout, stderr strings.Builder
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// cache is the artefact directory with its lock.
type cache struct {
	dir string
}

func openCache() (*cache, error) {
	dir := CacheDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("guest cache %s: %w", dir, err)
	}
	return &cache{dir: dir}, nil
}

func (c *cache) path(name string) string { return filepath.Join(c.dir, name) }

// build returns the cached artefact name, making it with make under the
// cache lock when it is missing. mk writes into tmp (a file or directory
// path in the cache dir that does not exist yet); build renames it into
// place, so a present artefact is always complete.
func (c *cache) build(ctx context.Context, name string, mk func(tmp string) error) (string, error) {
	final := c.path(name)
	if _, err := os.Stat(final); err == nil {
		return final, nil
	}
	unlock, err := c.lock(ctx)
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, err := os.Stat(final); err == nil {
		return final, nil // another process made it while we waited
	}
	tmp := c.path(fmt.Sprintf(".tmp-%d-%s", os.Getpid(), name))
	_ = os.RemoveAll(tmp)
	if err := mk(tmp); err != nil {
		_ = os.RemoveAll(tmp)
		return "", fmt.Errorf("build %s: %w", name, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		_ = os.RemoveAll(tmp)
		return "", fmt.Errorf("build %s: %w", name, err)
	}
	return final, nil
}

// lock takes the cache's exclusive file lock, giving up when ctx ends. It
// polls rather than blocks, so that an ended ctx never leaves a blocked
// flock behind.
func (c *cache) lock(ctx context.Context) (unlock func(), err error) {
	f, err := os.OpenFile(c.path(".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("guest cache lock: %w", err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("guest cache lock: %w", err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("guest cache lock: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// hasher accumulates a cache key.
type hasher struct{ h io.Writer }

func newKey() (*hasher, func() string) {
	h := sha256.New()
	k := &hasher{h: h}
	k.add(builderVersion)
	return k, func() string { return hex.EncodeToString(h.Sum(nil))[:16] }
}

func (k *hasher) add(parts ...string) {
	for _, p := range parts {
		fmt.Fprintf(k.h, "%d:%s;", len(p), p)
	}
}

func (k *hasher) addFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	k.add(path, fmt.Sprint(st.Size()))
	_, err = io.Copy(k.h, f)
	return err
}
