// Package libvirttest gives tests a real libvirtd serving qemu:///system.
//
// When none runs (no systemd on the build machines), Ensure starts libvirtd
// and virtlogd as plain daemons. Those daemons are shared by every test binary
// of the run and left running afterwards; a daemon that was already running
// is used as it is and never stopped.
package libvirttest

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// URI is the connection URI of the system libvirtd.
const URI = "qemu:///system"

const (
	libvirtdSocket = "/run/libvirt/libvirt-sock"
	virtlogdSocket = "/run/libvirt/virtlogd-sock"
	lockFile       = "/run/lock/nodevirt-libvirttest.lock"
	startTimeout   = 30 * time.Second
)

var (
	once    sync.Once
	onceErr error
)

// Ensure returns the URI of a running libvirtd (qemu:///system), starting
// virtlogd and libvirtd when their sockets do not answer. It fails t when no
// daemon can be had.
func Ensure(t testing.TB) string {
	t.Helper()
	if err := Start(); err != nil {
		t.Fatalf("libvirtd: %v", err)
	}
	return URI
}

// Start is Ensure for programs (benchmarks): it makes sure libvirtd and
// virtlogd run, starting them when needed, and returns why not.
func Start() error {
	once.Do(func() { onceErr = ensure() })
	return onceErr
}

func answers(socket string) bool {
	c, err := net.DialTimeout("unix", socket, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func ensure() error {
	if err := KVMDeviceAccess(); err != nil {
		return err
	}
	if answers(libvirtdSocket) && answers(virtlogdSocket) {
		return nil
	}
	// Test binaries of one run start in parallel: one of them starts the
	// daemons, the others wait on the lock and then find them running.
	if err := os.MkdirAll(filepath.Dir(lockFile), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(lockFile, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("lock %s: %w", lockFile, err)
	}
	defer syscall.Flock(int(f.Fd()), syscall.LOCK_UN)

	for _, d := range []struct{ bin, socket string }{
		{"virtlogd", virtlogdSocket},
		{"libvirtd", libvirtdSocket},
	} {
		if answers(d.socket) {
			continue
		}
		// Its errors go to a file: a daemon that exits at start (a
		// configuration it refuses) says why there.
		logFile := filepath.Join(filepath.Dir(lockFile), "nodevirt-"+d.bin+".log")
		cmd := exec.Command(d.bin, "-d")
		cmd.Env = append(os.Environ(), "LIBVIRT_LOG_OUTPUTS=4:file:"+logFile)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("start %s: %w: %s", d.bin, err, out)
		}
		deadline := time.Now().Add(startTimeout)
		for !answers(d.socket) {
			if time.Now().After(deadline) {
				return fmt.Errorf("%s started but %s does not answer after %s; its errors (%s):\n%s",
					d.bin, d.socket, startTimeout, logFile, tail(logFile, 2048))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// tail is the last n bytes of file.
func tail(file string, n int64) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	return string(b[max(0, int64(len(b))-n):])
}

// KVMDeviceAccess gives /dev/kvm the group and mode Debian's udev rule gives
// it (root:kvm 0660) when no udev did. Without it libvirtd finds its cached
// QEMU capabilities stale on every call (they were probed with KVM, which
// the qemu user then cannot open) and re-probes QEMU for tens of seconds per
// define or start. A missing /dev/kvm is fine.
func KVMDeviceAccess() error {
	st, err := os.Stat("/dev/kvm")
	if err != nil {
		return nil
	}
	if st.Mode().Perm()&0o060 == 0o060 {
		return nil
	}
	grp, err := user.LookupGroup("kvm")
	if err != nil {
		return nil // no kvm group: nothing udev would have done either
	}
	gid, err := strconv.Atoi(grp.Gid)
	if err != nil {
		return fmt.Errorf("kvm group id %q: %w", grp.Gid, err)
	}
	if err := os.Chown("/dev/kvm", 0, gid); err != nil {
		return fmt.Errorf("/dev/kvm: %w", err)
	}
	if err := os.Chmod("/dev/kvm", st.Mode().Perm()|0o060); err != nil {
		return fmt.Errorf("/dev/kvm: %w", err)
	}
	return nil
}

// StateDir makes a per-test directory that QEMU (which libvirt runs as an
// unprivileged user) can reach, removed when the test ends.
func StateDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "nodevirt-vm-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
