package confine

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nodevirt/nodevirt/test/testkit"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("confinement needs root")
	}
}

// TestSeesOnlyItsBinds: the host's files are not there, the bound ones are,
// read-only ones cannot be written, and the program is not root.
func TestSeesOnlyItsBinds(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	in := filepath.Join(dir, "in.txt")
	out := filepath.Join(dir, "out.txt")
	os.WriteFile(in, []byte("input\n"), 0o644)
	os.WriteFile(out, nil, 0o666)
	restore, err := Own(out, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer restore()
	script := `id -u; id -g; cat /in/image; echo written > /out/disk; ` +
		`if cat /etc/passwd 2>/dev/null; then echo HOST-VISIBLE; fi; ` +
		`if echo x > /in/image 2>/dev/null; then echo RO-WRITABLE; fi; ` +
		`if ls /root /var /home /proc/1/root 2>/dev/null; then echo HOST-DIRS; fi; ` +
		`if cat /sys/class/net/*/address 2>/dev/null; then echo SYS; fi; ` +
		`ls /`
	got, err := Run(context.Background(), Spec{Binds: []Bind{{Host: in, Path: "/in/image"}, {Host: out, Path: "/out/disk", Writable: true}}},
		"/bin/sh", "-c", script)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	lines := string(got)
	for _, bad := range []string{"HOST-VISIBLE", "RO-WRITABLE", "HOST-DIRS", "SYS"} {
		if strings.Contains(lines, bad) {
			t.Errorf("sandbox leaks (%s):\n%s", bad, lines)
		}
	}
	if !strings.HasPrefix(lines, "65534\n65534\ninput\n") {
		t.Errorf("output %q, want uid/gid 65534 and the input", lines)
	}
	if b, _ := os.ReadFile(out); string(b) != "written\n" {
		t.Errorf("output file %q, want written", b)
	}
	if b, _ := os.ReadFile(in); string(b) != "input\n" {
		t.Errorf("input changed: %q", b)
	}
}

// TestLimits: the address-space and CPU limits hold.
func TestLimits(t *testing.T) {
	needRoot(t)
	got, err := Run(context.Background(), Spec{Limits: Limits{CPU: 3 * time.Second, AddressSpace: 256 << 20}},
		"/bin/sh", "-c", "ulimit -t; ulimit -v")
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "3\n262144\n" {
		t.Errorf("limits %q, want 3 s and 262144 KiB", got)
	}
	// A program past its CPU time is killed by the kernel (SIGXCPU).
	t0 := time.Now()
	_, err = Run(context.Background(), Spec{Limits: Limits{CPU: time.Second}}, "/bin/sh", "-c", "while :; do :; done")
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("busy loop under a 1 s cpu limit: %v, want it killed", err)
	}
	if d := time.Since(t0); d > 20*time.Second {
		t.Errorf("busy loop ran %v", d)
	}
}

// TestCancelKillsTheGroup: canceling the context kills the program, not
// only the unshare in front of it.
func TestCancelKillsTheGroup(t *testing.T) {
	needRoot(t)
	ctx, cancel := context.WithCancel(context.Background())
	spec := Spec{}
	var stdout bytes.Buffer
	wait, err := Start(ctx, spec, func(c *exec.Cmd) error { c.Stdout = &stdout; return nil }, "/bin/sh", "-c", "echo $$; exec sleep 1000")
	if err != nil {
		t.Fatal(err)
	}
	sleeping := func() []string {
		out, _ := exec.Command("pgrep", "-f", "^sleep 1000$").Output()
		return strings.Fields(string(out))
	}
	testkit.Until(t, 10*time.Second, "the confined sleep to start", func() bool { return len(sleeping()) > 0 })
	cancel()
	done := make(chan error, 1)
	go func() { done <- wait() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("confined program outlived its context")
	}
	if left := sleeping(); len(left) > 0 {
		t.Errorf("sleep still running as %v", left)
	}
}

func TestRefusesBadBinds(t *testing.T) {
	needRoot(t)
	_, err := Run(context.Background(), Spec{Binds: []Bind{{Host: "/etc/hostname", Path: "/usr/x"}}}, "/bin/true")
	if err == nil {
		t.Fatal("bind outside /in and /out accepted")
	}
}

// TestOutputIsBounded: a program printing without end does not grow the
// caller.
func TestOutputIsBounded(t *testing.T) {
	needRoot(t)
	_, err := Run(context.Background(), Spec{}, "/bin/sh", "-c", "yes | head -c 8388608")
	if err == nil || !strings.Contains(err.Error(), "printed more than") {
		t.Fatalf("8 MiB of output: %v, want refused", err)
	}
}
