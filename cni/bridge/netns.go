package bridge

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/vishvananda/netns"
)

// doInNetNS runs fn on an OS thread switched into target, then switches the
// thread back. If switching back fails the thread is left locked, so the Go
// runtime discards it instead of reusing it in the wrong namespace.
func doInNetNS(target netns.NsHandle, fn func() error) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(target); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns: %w", err)
	}
	fnErr := fn()
	if err := netns.Set(orig); err != nil {
		return fmt.Errorf("return to original netns: %w", err)
	}
	runtime.UnlockOSThread()
	return fnErr
}

// writeSysctl writes value to /proc/sys/<key> (key uses '/' separators) in
// the calling thread's network namespace, unless it already has that value
// (writing a forwarding switch walks every device under the RTNL lock).
func writeSysctl(key, value string) error {
	p := filepath.Join("/proc/sys", key)
	if cur, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(cur)) == value {
		return nil
	}
	if err := os.WriteFile(p, []byte(value), 0o644); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", strings.ReplaceAll(key, "/", "."), value, err)
	}
	return nil
}
