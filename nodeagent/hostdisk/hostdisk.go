// Package hostdisk resolves KubeVirt hostDisk volumes on a node, confined to
// a directory the node's administrator allows (the root).
//
// A hostDisk path names a file on the node. The node agent runs as root, so
// a path taken as given would open any host file (/etc/shadow) for the
// guest. Resolve accepts only paths inside the root and opens them with
// openat2(2) relative to the root with RESOLVE_BENEATH,
// RESOLVE_NO_SYMLINKS and RESOLVE_NO_MAGICLINKS: a ".." or a symlink
// anywhere in the path below the root is refused, never followed, so the
// file opened is the file named, inside the root. The path handed to
// libvirt is the one the kernel reports for the opened file.
//
// What it does not cover: the root is trusted (whoever can rename
// directories inside it between Resolve and QEMU's open can still redirect
// that open); keep it writable by root only.
package hostdisk

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	v1 "kubevirt.io/api/core/v1"
)

// DefaultRoot is where hostDisk images may live unless the node agent is
// told otherwise (--host-disk-root).
const DefaultRoot = "/var/lib/nodevirt/hostdisks"

// ErrRefused marks a hostDisk the node will not open: outside the root,
// through a symlink, or not a regular file. The VMI fails with it.
var ErrRefused = errors.New("hostDisk refused")

// Resolver opens hostDisk paths inside Root.
type Resolver struct {
	root string
}

// New returns a resolver confined to root (absolute; DefaultRoot when
// empty). The root need not exist yet: Resolve fails until it does.
func New(root string) (*Resolver, error) {
	if root == "" {
		root = DefaultRoot
	}
	if !filepath.IsAbs(root) {
		return nil, fmt.Errorf("host disk root %q is not an absolute path", root)
	}
	return &Resolver{root: filepath.Clean(root)}, nil
}

// Root is the directory hostDisk paths must lie in.
func (r *Resolver) Root() string { return r.root }

// resolveFlags confine a lookup to the directory it starts from and refuse
// every symlink on the way.
const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// Resolve returns the file of hd on this node. A DiskOrCreate disk that is
// missing is created (sparse, hd.Capacity bytes, with missing directories
// below the root); created tells so, for the caller's undo.
func (r *Resolver) Resolve(hd *v1.HostDisk) (path string, created bool, err error) {
	rel, err := r.relative(hd.Path)
	if err != nil {
		return "", false, err
	}
	rootFD, err := unix.Open(r.root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", false, fmt.Errorf("host disk root %s: %w", r.root, err)
	}
	defer unix.Close(rootFD)

	fd, err := openBeneath(rootFD, rel, unix.O_PATH|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) && hd.Type == v1.HostDiskExistsOrCreate {
		fd, err = r.create(rootFD, rel, hd.Capacity.Value())
		created = err == nil
	}
	if err != nil {
		return "", false, r.explain(hd.Path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", false, fmt.Errorf("hostDisk %s: %w", hd.Path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return "", false, fmt.Errorf("%w: hostDisk path %s is not a regular file", ErrRefused, hd.Path)
	}
	resolved, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		return "", false, fmt.Errorf("hostDisk %s: %w", hd.Path, err)
	}
	return resolved, created, nil
}

// relative is p below the root, refusing what lies elsewhere.
func (r *Resolver) relative(p string) (string, error) {
	if !filepath.IsAbs(p) {
		return "", fmt.Errorf("%w: hostDisk path %q is not absolute", ErrRefused, p)
	}
	rel, err := filepath.Rel(r.root, filepath.Clean(p))
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", fmt.Errorf("%w: hostDisk path %s is outside the node's host disk root %s", ErrRefused, p, r.root)
	}
	return rel, nil
}

func (r *Resolver) explain(p string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP):
		return fmt.Errorf("%w: hostDisk path %s goes through a symlink (not followed below %s)", ErrRefused, p, r.root)
	case errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%w: hostDisk path %s leaves the node's host disk root %s", ErrRefused, p, r.root)
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("hostDisk %s does not exist: %w", p, err)
	}
	return fmt.Errorf("hostDisk %s: %w", p, err)
}

// openBeneath opens rel below dirFD without following any symlink or
// leaving dirFD's tree.
func openBeneath(dirFD int, rel string, flags int, mode uint32) (int, error) {
	for {
		fd, err := unix.Openat2(dirFD, rel, &unix.OpenHow{Flags: uint64(flags), Mode: uint64(mode), Resolve: resolveFlags})
		if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
			continue
		}
		return fd, err
	}
}

// create makes rel (and its missing parent directories) below rootFD: a
// sparse file of size bytes, opened O_EXCL so nothing already there is
// taken over.
func (r *Resolver) create(rootFD int, rel string, size int64) (int, error) {
	if size <= 0 {
		return -1, fmt.Errorf("%w: capacity must be positive to create a hostDisk", ErrRefused)
	}
	dirFD, err := unix.Dup(rootFD)
	if err != nil {
		return -1, err
	}
	defer func() { unix.Close(dirFD) }()
	parts := strings.Split(rel, "/")
	for _, name := range parts[:len(parts)-1] {
		if err := unix.Mkdirat(dirFD, name, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
			return -1, err
		}
		next, err := openBeneath(dirFD, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		unix.Close(dirFD)
		dirFD = next
	}
	name := parts[len(parts)-1]
	fd, err := openBeneath(dirFD, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return -1, err
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		_ = unix.Unlinkat(dirFD, name, 0)
		return -1, err
	}
	return fd, nil
}
