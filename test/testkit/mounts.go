package testkit

import (
	"errors"
	"os"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// UnmountBelowAtCleanup detaches, when the test ends, every mount at or
// below dir (deepest first), such as the shared bind mount the CSI driver
// makes of a pool's volumes directory. Call it right after making dir, so
// it runs before dir is removed.
func UnmountBelowAtCleanup(t testing.TB, dir string) {
	t.Helper()
	t.Cleanup(func() {
		b, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil {
			t.Errorf("read mountinfo: %v", err)
			return
		}
		prefix := strings.TrimSuffix(dir, "/") + "/"
		var targets []string
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) < 5 {
				continue
			}
			mp := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(f[4])
			if mp == dir || strings.HasPrefix(mp, prefix) {
				targets = append(targets, mp)
			}
		}
		sort.Slice(targets, func(i, j int) bool { return len(targets[i]) > len(targets[j]) })
		for _, mp := range targets {
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				t.Errorf("unmount %s: %v", mp, err)
			}
		}
	})
}
