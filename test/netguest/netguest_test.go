package netguest_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nodevirt/nodevirt/test/netguest"
)

func buildStatic(t *testing.T, ctx context.Context, out, pkg string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
	cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v: %s", pkg, err, b)
	}
}

// TestVLANIsolationInGuest boots Debian's cloud kernel under TCG and runs
// vlan.sh there: same-VLAN namespaces talk, other VLANs and forged MACs are
// cut off, DEL without netns and GC leave no port, VLAN entry or rule.
func TestVLANIsolationInGuest(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), netguest.BootTimeout+3*time.Minute)
	defer cancel()
	work := t.TempDir()
	plugin := filepath.Join(work, "cnv-bridge")
	driver := filepath.Join(work, "cnidrv")
	buildStatic(t, ctx, plugin, "github.com/nodevirt/nodevirt/cni/cmd/cnv-bridge")
	buildStatic(t, ctx, driver, "github.com/nodevirt/nodevirt/test/netguest/cnidrv")
	img, err := netguest.Build(ctx, netguest.Spec{
		WorkDir:  work,
		Binaries: map[string]string{"/cni/cnv-bridge": plugin, "/bin/cnidrv": driver},
		Script:   netguest.VLANScript,
	})
	if err != nil {
		t.Fatal(err)
	}
	bootCtx, bootCancel := context.WithTimeout(ctx, netguest.BootTimeout)
	defer bootCancel()
	start := time.Now()
	console, err := netguest.Boot(bootCtx, img)
	t.Logf("guest ran %v; console:\n%s", time.Since(start).Round(time.Millisecond), console)
	if err != nil {
		t.Fatal(err)
	}
	if err := netguest.Verdict(console); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(console, "modules loaded") {
		t.Fatal("guest never reached its test")
	}
}
