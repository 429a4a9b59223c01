package buildinfo

import (
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A binary built from this checkout carries its revision, and -ldflags -X
// overrides the version and stamp; both are what --version prints.
func TestStampOfABuiltBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a binary")
	}
	dir := t.TempDir()
	// The probe must be a package of this module to import buildinfo: a
	// throwaway directory under this one.
	pkg, err := os.MkdirTemp(".", "probe")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(pkg) })
	src := "package main\n\nimport (\n\t\"fmt\"\n\n\t\"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo\"\n)\n\nfunc main() { fmt.Println(buildinfo.Line(\"probe\")) }\n"
	if err := os.WriteFile(filepath.Join(pkg, "main.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(flags ...string) string {
		t.Helper()
		bin := filepath.Join(dir, "probe")
		args := append([]string{"build", "-o", bin}, flags...)
		out, err := exec.Command("go", append(args, "./"+pkg)...).CombinedOutput()
		if err != nil {
			t.Fatalf("go build: %v\n%s", err, out)
		}
		out, err = exec.Command(bin).Output()
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(out))
	}

	// The toolchain stamps a build in a checkout whose .git is a directory
	// (not in a git worktree): whatever it recorded, --version prints.
	got := run("-buildvcs=auto")
	meta, err := exec.Command("go", "version", "-m", filepath.Join(dir, "probe")).Output()
	if err != nil {
		t.Fatal(err)
	}
	// The version is the module's pseudo-version when the toolchain
	// stamped one, else devel; the revision and time are what it recorded.
	want := "(revision unknown, committed unknown"
	if _, rev, ok := strings.Cut(string(meta), "vcs.revision="); ok {
		rev, _, _ = strings.Cut(rev, "\n")
		_, when, _ := strings.Cut(string(meta), "vcs.time=")
		when, _, _ = strings.Cut(when, "\n")
		want = "(revision " + rev + ", committed " + when
	} else {
		t.Log("the toolchain recorded no revision (not a checkout, or a git worktree)")
	}
	if !strings.HasPrefix(got, "probe ") || !strings.Contains(got, want) {
		t.Errorf("stamp from the toolchain: %q, want %q in it", got, want)
	}
	const p = "github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo."
	got = run("-ldflags", "-X "+p+"version=v1.2.3 -X "+p+"revision=abc -X "+p+"buildTime=2026-01-02T03:04:05Z")
	if !strings.HasPrefix(got, "probe v1.2.3 (revision abc, committed 2026-01-02T03:04:05Z") {
		t.Errorf("stamp from -ldflags: %q", got)
	}
}

func TestRequested(t *testing.T) {
	for args, want := range map[string]bool{"--version": true, "-version": true, "": false, "version": false, "--version x": false} {
		if got := Requested(strings.Fields(args)); got != want {
			t.Errorf("Requested(%q) = %v, want %v", args, got, want)
		}
	}
}

// The package stays a leaf: only the standard library.
func TestImportsOnlyTheStandardLibrary(t *testing.T) {
	files, _ := filepath.Glob("*.go")
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, im := range af.Imports {
			if path := strings.Trim(im.Path.Value, `"`); strings.Contains(strings.SplitN(path, "/", 2)[0], ".") {
				t.Errorf("%s imports %s", f, path)
			}
		}
	}
}
