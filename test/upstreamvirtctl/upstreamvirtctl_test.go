package upstreamvirtctl

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nodevirt/nodevirt/test/controlplane"
)

func TestPinnedVersion(t *testing.T) {
	dir := t.TempDir()
	mod := "module x\n\ngo 1.26\n\nrequire kubevirt.io/kubevirt v1.7.0\n"
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(mod), 0o644); err != nil {
		t.Fatal(err)
	}
	if v, err := PinnedVersion(dir); err != nil || v != "v1.7.0" {
		t.Fatalf("PinnedVersion = %q, %v; want v1.7.0", v, err)
	}
	block := "module x\n\nrequire (\n\tfoo.io/bar v0.1.0\n\tkubevirt.io/kubevirt v1.6.3 // indirect\n)\n"
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(block), 0o644); err != nil {
		t.Fatal(err)
	}
	if v, err := PinnedVersion(dir); err != nil || v != "v1.6.3" {
		t.Fatalf("PinnedVersion = %q, %v; want v1.6.3", v, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := PinnedVersion(dir); err == nil {
		t.Fatal("PinnedVersion of a module without kubevirt.io/kubevirt succeeded")
	}
}

// TestBinary: two callers at once get the same cached binary, which is the
// pinned release's virtctl (built on first use; a few minutes cold).
func TestBinary(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	paths := make([]string, 2)
	errs := make([]error, 2)
	for i := range paths {
		wg.Add(1)
		go func() {
			defer wg.Done()
			paths[i], errs[i] = Binary(ctx)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if paths[0] != paths[1] {
		t.Fatalf("concurrent callers got %s and %s", paths[0], paths[1])
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	want, err := PinnedVersion(filepath.Join(root, toolsModule))
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(ctx, paths[0], "version", "--client").CombinedOutput()
	if err != nil {
		t.Fatalf("virtctl version --client: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), `GitVersion:"`+want+`"`) {
		t.Fatalf("virtctl version --client = %s, want GitVersion %s", out, want)
	}
}
