// Package confine runs a program that parses untrusted bytes (qemu-img on
// an uploaded image, xz on a downloaded stream) where it can do little
// harm. The program runs:
//
//   - in its own mount namespace whose root is an empty tmpfs holding only
//     /usr (read-only, for the program and its libraries), /etc/ld.so.cache,
//     /dev/null and the files the caller binds in (the image read-only, the
//     destination read-write): the host's files, /etc/passwd, other volumes,
//     sockets, are not there to be opened, whatever the image names;
//   - in its own network, IPC and PID namespaces (no network at all);
//   - as an unprivileged uid/gid (65534, nobody) with no capabilities and
//     no supplementary groups, so it cannot remount or leave its root;
//   - under setrlimit limits on CPU seconds and address space;
//   - in its own process group, killed whole when the context ends.
//
// Setting up the namespaces needs root (CAP_SYS_ADMIN); there is no
// unconfined fallback: without it Command fails. The binaries used are
// util-linux's unshare, mount and prlimit and /bin/sh.
package confine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// DefaultUID and DefaultGID are the identity the confined program runs as
// (Debian's nobody/nogroup).
const (
	DefaultUID = 65534
	DefaultGID = 65534
)

// Limits bound what the confined program may use. Zero means unlimited.
type Limits struct {
	// CPU is the CPU time (RLIMIT_CPU), rounded up to whole seconds.
	CPU time.Duration
	// AddressSpace is the virtual memory size in bytes (RLIMIT_AS).
	AddressSpace int64
	// FileSize is the largest file the program may write (RLIMIT_FSIZE).
	FileSize int64
}

// Bind makes a host file (or device) visible inside the sandbox.
type Bind struct {
	// Host is the file's path on the host; it must exist.
	Host string
	// Path is where the program sees it: an absolute path under /in or
	// /out (no other directory of the sandbox root is writable).
	Path string
	// Writable binds it read-write; otherwise read-only.
	Writable bool
}

// Spec describes one confined run.
type Spec struct {
	Binds  []Bind
	Limits Limits
	// UID and GID the program runs as; 0 means DefaultUID/DefaultGID. The
	// caller makes the bound files accessible to them (see Own).
	UID, GID int
	// RootDir is an empty directory on the host that the sandbox's root
	// tmpfs is mounted on, inside the sandbox's own mount namespace only
	// (the host sees an empty directory). Empty means a new directory under
	// os.TempDir(), removed when the command ends.
	RootDir string
}

// setupScript runs as root inside the new namespaces: it builds the root
// tmpfs and execs the rest of its arguments. Positional arguments: root
// dir, the number of binds, then (mode, host, path) triples, then the
// command. Paths are never interpolated into the script text.
const setupScript = `set -eu
root=$1; n=$2; shift 2
mount -t tmpfs -o mode=0755,size=1m,nosuid,nodev nodevirt-confine "$root"
mkdir -p "$root/usr" "$root/etc" "$root/dev" "$root/in" "$root/out" "$root/tmp"
mount -t tmpfs -o mode=1777,size=1m,nosuid,nodev nodevirt-confine-tmp "$root/tmp"
mount --rbind /usr "$root/usr"
mount -o remount,bind,ro,nosuid,nodev "$root/usr"
for l in bin sbin lib lib32 lib64 libx32; do
  if [ -L "/$l" ]; then ln -s "$(readlink "/$l")" "$root/$l"
  elif [ -d "/$l" ]; then mkdir "$root/$l"; mount --rbind "/$l" "$root/$l"; mount -o remount,bind,ro "$root/$l"; fi
done
touch "$root/etc/ld.so.cache" "$root/dev/null"
[ -f /etc/ld.so.cache ] && mount --bind /etc/ld.so.cache "$root/etc/ld.so.cache" && mount -o remount,bind,ro "$root/etc/ld.so.cache"
mount --bind /dev/null "$root/dev/null"
while [ "$n" -gt 0 ]; do
  mode=$1; host=$2; path=$3; shift 3; n=$((n-1))
  mkdir -p "$root$(dirname "$path")"
  touch "$root$path"
  mount --bind "$host" "$root$path"
  if [ "$mode" = ro ]; then mount -o remount,bind,ro,nosuid "$root$path"; else mount -o remount,bind,nosuid "$root$path"; fi
done
mount -o remount,ro,nosuid,nodev "$root"
exec "$@"
`

// Command returns the command running name with args confined by spec.
// The command is started and waited for as usual; canceling ctx kills its
// whole process group. Errors are in the returned command's Err field (as
// exec.CommandContext reports a missing binary).
func Command(ctx context.Context, spec Spec, name string, args ...string) *exec.Cmd {
	uid, gid := spec.UID, spec.GID
	if uid == 0 {
		uid = DefaultUID
	}
	if gid == 0 {
		gid = DefaultGID
	}
	argv, err := spec.argv(uid, gid, name, args)
	cmd := exec.CommandContext(ctx, "unshare", argv...)
	if err != nil {
		cmd.Err = err
		return cmd
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if spec.Limits.AddressSpace > 0 {
		// Under an address-space limit, glibc's per-thread malloc arenas
		// (64 MiB reserved each, up to 8 per core) can exhaust it when
		// threads contend, and a program like qemu-img then fails to
		// start a thread; two arenas bound that reservation.
		cmd.Env = append(os.Environ(), "MALLOC_ARENA_MAX=2")
	}
	cmd.Cancel = func() error {
		if cmd.Process == nil {
			return nil
		}
		// The whole group: unshare, the setup shell and the program.
		return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

func (spec *Spec) argv(uid, gid int, name string, args []string) ([]string, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("confine: confining a program needs root")
	}
	root := spec.RootDir
	if root == "" {
		return nil, errors.New("confine: no root directory")
	}
	argv := []string{"--mount", "--net", "--ipc", "--uts", "--pid", "--fork", "--kill-child", "--propagation", "private",
		"--", "/bin/sh", "-c", setupScript, "confine", root, strconv.Itoa(len(spec.Binds))}
	for _, b := range spec.Binds {
		if !filepath.IsAbs(b.Path) || filepath.Clean(b.Path) != b.Path ||
			(filepath.Dir(b.Path) != "/in" && filepath.Dir(b.Path) != "/out") {
			return nil, fmt.Errorf("confine: bind path %q is not a file directly under /in or /out", b.Path)
		}
		if _, err := os.Stat(b.Host); err != nil {
			return nil, fmt.Errorf("confine: bind %s: %w", b.Path, err)
		}
		mode := "ro"
		if b.Writable {
			mode = "rw"
		}
		argv = append(argv, mode, b.Host, b.Path)
	}
	argv = append(argv, "prlimit")
	l := spec.Limits
	if l.CPU > 0 {
		argv = append(argv, "--cpu="+strconv.FormatInt(int64((l.CPU+time.Second-1)/time.Second), 10))
	}
	if l.AddressSpace > 0 {
		argv = append(argv, "--as="+strconv.FormatInt(l.AddressSpace, 10))
	}
	if l.FileSize > 0 {
		argv = append(argv, "--fsize="+strconv.FormatInt(l.FileSize, 10))
	}
	argv = append(argv, "--core=0", "--",
		"unshare", "--root="+root, "--wd=/tmp", "--setuid="+strconv.Itoa(uid), "--setgid="+strconv.Itoa(gid), "--", name)
	return append(argv, args...), nil
}

// Run is Command with a temporary root directory made and removed around
// the run; it returns the program's standard output. A failure carries
// the program's standard error.
func Run(ctx context.Context, spec Spec, name string, args ...string) ([]byte, error) {
	cleanup, err := spec.ensureRoot()
	if err != nil {
		return nil, err
	}
	defer cleanup()
	cmd := Command(ctx, spec, name, args...)
	stdout, stderr := &limitedBuffer{max: MaxOutput}, &limitedBuffer{max: 64 << 10}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &ExitError{Err: err, Stderr: stderr.String()}
	}
	if stdout.dropped {
		return nil, fmt.Errorf("confine: %s printed more than %d bytes", name, MaxOutput)
	}
	return stdout.b, nil
}

// MaxOutput bounds what Run keeps of a program's standard output (it is
// held in the caller's memory).
const MaxOutput = 4 << 20

// Start is Command with a temporary root directory, started; the returned
// wait waits for the program and removes the root directory.
func Start(ctx context.Context, spec Spec, setup func(*exec.Cmd) error, name string, args ...string) (wait func() error, err error) {
	cleanup, err := spec.ensureRoot()
	if err != nil {
		return nil, err
	}
	cmd := Command(ctx, spec, name, args...)
	if setup != nil {
		if err := setup(cmd); err != nil {
			cleanup()
			return nil, err
		}
	}
	if err := cmd.Start(); err != nil {
		cleanup()
		return nil, fmt.Errorf("confine: start %s: %w", name, err)
	}
	return func() error {
		defer cleanup()
		return cmd.Wait()
	}, nil
}

// ensureRoot makes spec.RootDir when unset and returns what removes it.
func (spec *Spec) ensureRoot() (func(), error) {
	if spec.RootDir != "" {
		return func() {}, nil
	}
	dir, err := os.MkdirTemp("", "nodevirt-confine-")
	if err != nil {
		return nil, fmt.Errorf("confine: root directory: %w", err)
	}
	spec.RootDir = dir
	return func() { os.Remove(dir) }, nil
}

// Own gives path to uid/gid (so that a confined program running as them
// can open it) and returns what gives it back to its previous owner.
func Own(path string, uid, gid int) (restore func() error, err error) {
	if uid == 0 {
		uid = DefaultUID
	}
	if gid == 0 {
		gid = DefaultGID
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	sys := st.Sys().(*syscall.Stat_t)
	if err := os.Chown(path, uid, gid); err != nil {
		return nil, fmt.Errorf("confine: give %s to uid %d: %w", path, uid, err)
	}
	return func() error { return os.Chown(path, int(sys.Uid), int(sys.Gid)) }, nil
}

// ExitError is a confined program that failed.
type ExitError struct {
	Err    error
	Stderr string
}

func (e *ExitError) Error() string {
	if e.Stderr == "" {
		return e.Err.Error()
	}
	return fmt.Sprintf("%v: %s", e.Err, e.Stderr)
}

func (e *ExitError) Unwrap() error { return e.Err }

// limitedBuffer keeps the first max bytes written to it.
type limitedBuffer struct {
	b       []byte
	max     int
	dropped bool
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	room := l.max - len(l.b)
	if room < len(p) {
		l.dropped = true
	}
	if room > 0 {
		l.b = append(l.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (l *limitedBuffer) String() string { return string(bytes.TrimSpace(l.b)) }
