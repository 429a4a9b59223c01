package csi

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// mountsAt lists the mountinfo lines whose mount point is dir.
func mountsAt(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			lines = append(lines, line)
		}
	}
	return lines
}

// TestSharePools: with SharePools each pool's volumes directory is a shared
// mount of its own, made once however often the driver starts, and a
// volume mounted after a process entered a mount namespace that is a
// recursive slave of this one (what libvirt makes for QEMU) is seen there.
// The volume mounted before is seen too.
func TestSharePools(t *testing.T) {
	requireRoot(t)
	cfg := testConfig(t)
	testkit.UnmountBelowAtCleanup(t, cfg.StateRoot)
	cfg.SharePools = true
	d, sock := startDriver(t, cfg)
	c := newClients(t, sock)
	before := c.create(t, "pvc-before", "fast", 16*mib, mountCap(rw))

	// A QEMU stand-in: a new mount namespace, slave of this one.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	guest := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "slave", "sleep", "600")
	if err := guest.Start(); err != nil {
		t.Fatal(err)
	}
	defer guest.Wait()
	defer cancel()
	inGuest := func(args ...string) ([]byte, error) {
		return exec.Command("nsenter", append([]string{"-t", strconv.Itoa(guest.Process.Pid), "-m", "--"}, args...)...).CombinedOutput()
	}
	// unshare has made its namespace slave once it runs sleep.
	testkit.Eventually(t, 30*time.Second, "the stand-in to run sleep", func() error {
		comm, err := os.ReadFile("/proc/" + strconv.Itoa(guest.Process.Pid) + "/comm")
		if err == nil && string(comm) != "sleep\n" {
			err = errors.New("still " + strings.TrimSpace(string(comm)))
		}
		return err
	})

	after := c.create(t, "pvc-after", "fast", 16*mib, mountCap(rw))
	for _, vol := range []string{before.GetVolumeId(), after.GetVolumeId()} {
		disk, _, err := d.VolumeDisk(vol)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(disk, []byte("seen-"+vol), 0o600); err != nil {
			t.Fatal(err)
		}
		if out, err := inGuest("cat", disk); err != nil || string(out) != "seen-"+vol {
			t.Errorf("the stand-in reads %s as %q (%v)", disk, out, err)
		}
	}

	// Made once, shared, and not stacked by a restarted driver.
	for _, pc := range cfg.Pools {
		if _, err := New(cfg); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(pc.Path, "volumes")
		lines := mountsAt(t, dir)
		if len(lines) != 1 || !strings.Contains(lines[0], " shared:") {
			t.Errorf("mounts at %s: %q, want one shared mount", dir, lines)
		}
	}
}
