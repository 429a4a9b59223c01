package bridge_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoForkOnAddDel traces the plugin binary's process creation with
// strace: ADD (with spoof-check rules and host-local addresses) starts no
// process at all; a DEL with no other DEL running starts exactly one, the
// link-unregistration helper (see unregister.go for why that one cannot be
// a thread, and why concurrent DELs do without it).
func TestNoForkOnAddDel(t *testing.T) {
	strace, err := exec.LookPath("strace")
	if err != nil {
		t.Skip("strace not installed")
	}
	e := newEnv(t)
	c := e.container()
	conf := e.conf("1.0.0", "10.91.0.0/24", map[string]any{"macspoofchk": true, "isGateway": true})
	plugin := filepath.Join(pluginDir(t), "cnv-bridge")
	run := func(verb string) (execs, forks int) {
		t.Helper()
		trace := filepath.Join(t.TempDir(), "trace")
		cmd := exec.CommandContext(context.Background(), strace, "-f", "-qq", "-o", trace,
			"-e", "trace=execve,fork,vfork,clone,clone3", plugin)
		cmd.Env = append(os.Environ(), "CNI_COMMAND="+verb, "CNI_CONTAINERID=nofork", "CNI_NETNS="+c.Path,
			"CNI_IFNAME=eth0", "CNI_PATH="+pluginDir(t))
		cmd.Stdin = bytes.NewReader(conf)
		if err := e.host.Do(func() error {
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Logf("%s", out)
			}
			return err
		}); err != nil {
			t.Fatalf("%s: %v", verb, err)
		}
		b, err := os.ReadFile(trace)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			switch {
			case strings.Contains(line, "execve(") && !strings.Contains(line, "= -1"):
				execs++
			case (strings.Contains(line, "clone(") || strings.Contains(line, "clone3(") || strings.Contains(line, "fork(")) &&
				!strings.Contains(line, "CLONE_THREAD") && !strings.Contains(line, "resumed>"):
				forks++
			}
		}
		return execs, forks
	}
	if execs, forks := run("ADD"); execs != 1 || forks != 0 {
		t.Fatalf("ADD: %d execve (want 1, the plugin), %d process creations (want 0)", execs, forks)
	}
	if execs, forks := run("DEL"); execs != 2 || forks != 1 {
		t.Fatalf("DEL: %d execve (want 2, plugin and helper), %d process creations (want 1, the helper)", execs, forks)
	}
	if len(e.ports("br0")) != 0 || strings.Contains(e.ruleset(), "jump") || len(e.reservations()) != 0 {
		t.Fatalf("DEL left: ports %v ipam %v rules\n%s", e.ports("br0"), e.reservations(), e.ruleset())
	}
}
