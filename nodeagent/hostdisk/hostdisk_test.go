package hostdisk

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
	v1 "kubevirt.io/api/core/v1"
)

func TestResolveConfinesToRoot(t *testing.T) {
	tmp := t.TempDir()
	root := filepath.Join(tmp, "root")
	outside := filepath.Join(tmp, "secret")
	for _, d := range []string{root, filepath.Join(root, "vm"), outside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p string) {
		if err := os.WriteFile(p, []byte("data"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(root, "vm", "disk.img"))
	write(filepath.Join(outside, "shadow"))
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink(filepath.Join(outside, "shadow"), filepath.Join(root, "vm", "escape.img")))
	must(os.Symlink("disk.img", filepath.Join(root, "vm", "inside-link.img")))
	must(os.Symlink(outside, filepath.Join(root, "linkdir")))
	must(os.Symlink("/etc", filepath.Join(root, "etc")))

	r, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	got, created, err := r.Resolve(&v1.HostDisk{Path: filepath.Join(root, "vm", "disk.img"), Type: v1.HostDiskExists})
	if err != nil || created || got != filepath.Join(root, "vm", "disk.img") {
		t.Fatalf("disk inside the root: %q %v %v", got, created, err)
	}
	refused := []struct{ path, want string }{
		{"/etc/shadow", "outside the node's host disk root"},
		{filepath.Join(root, "..", "secret", "shadow"), "outside the node's host disk root"},
		{filepath.Join(root, "vm", "escape.img"), "symlink"},
		{filepath.Join(root, "vm", "inside-link.img"), "symlink"},
		{filepath.Join(root, "linkdir", "shadow"), "symlink"},
		{filepath.Join(root, "etc", "shadow"), "symlink"},
		{filepath.Join(root, "vm"), "not a regular file"},
		{root, "outside the node's host disk root"},
		{"vm/disk.img", "not absolute"},
	}
	for _, c := range refused {
		_, _, err := r.Resolve(&v1.HostDisk{Path: c.path, Type: v1.HostDiskExists})
		if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want a refusal saying %q", c.path, err, c.want)
		}
	}
	// DiskOrCreate through a symlinked directory creates nothing outside.
	_, _, err = r.Resolve(&v1.HostDisk{Path: filepath.Join(root, "linkdir", "new.img"), Type: v1.HostDiskExistsOrCreate,
		Capacity: resource.MustParse("1Mi")})
	if !errors.Is(err, ErrRefused) {
		t.Errorf("create through a symlinked directory: %v", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "new.img")); !os.IsNotExist(err) {
		t.Errorf("a file was created outside the root: %v", err)
	}
	// A dangling symlink as the disk itself is not created through.
	must(os.Symlink(filepath.Join(outside, "planted.img"), filepath.Join(root, "vm", "planted.img")))
	_, _, err = r.Resolve(&v1.HostDisk{Path: filepath.Join(root, "vm", "planted.img"), Type: v1.HostDiskExistsOrCreate,
		Capacity: resource.MustParse("1Mi")})
	if !errors.Is(err, ErrRefused) {
		t.Errorf("create through a dangling symlink: %v", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "planted.img")); !os.IsNotExist(err) {
		t.Errorf("a file was created outside the root: %v", err)
	}
}

func TestResolveCreatesSparseDisk(t *testing.T) {
	root := t.TempDir()
	r, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	hd := &v1.HostDisk{Path: filepath.Join(root, "a", "b", "disk.img"), Type: v1.HostDiskExistsOrCreate,
		Capacity: resource.MustParse("64Mi")}
	got, created, err := r.Resolve(hd)
	if err != nil || !created || got != hd.Path {
		t.Fatalf("create: %q %v %v", got, created, err)
	}
	st, err := os.Stat(got)
	if err != nil || st.Size() != 64<<20 {
		t.Fatalf("created disk: %v %v", st, err)
	}
	if _, created, err = r.Resolve(hd); err != nil || created {
		t.Fatalf("second resolve: created %v, %v", created, err)
	}
	if _, _, err := r.Resolve(&v1.HostDisk{Path: filepath.Join(root, "missing.img"), Type: v1.HostDiskExists}); err == nil ||
		errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("missing Disk: %v", err)
	}
}

func TestNewRefusesRelativeRoot(t *testing.T) {
	if _, err := New("var/lib"); err == nil {
		t.Error("a relative root was accepted")
	}
	r, err := New("")
	if err != nil || r.Root() != DefaultRoot {
		t.Errorf("default root: %v %v", r, err)
	}
}
