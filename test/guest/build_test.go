package guest

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func TestKernelIsCached(t *testing.T) {
	ctx := testContext(t)
	vmlinuz, modulesDir, err := Kernel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(vmlinuz); err != nil || st.Size() < 1<<20 {
		t.Fatalf("kernel image %s: %v (size %v)", vmlinuz, err, st)
	}
	if _, err := os.Stat(filepath.Join(modulesDir, "kernel", "drivers", "net", "virtio_net.ko")); err != nil {
		t.Fatalf("modules: %v", err)
	}
	start := time.Now()
	again, againMods, err := Kernel(ctx)
	if err != nil || again != vmlinuz || againMods != modulesDir {
		t.Fatalf("second Kernel() = %s, %s, %v; want the cached %s", again, againMods, err, vmlinuz)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("cached Kernel() took %v", d)
	}
}

func TestModulesResolveInDependencyOrder(t *testing.T) {
	_, modulesDir, err := Kernel(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	mods, err := indexModules(modulesDir)
	if err != nil {
		t.Fatal(err)
	}
	kos, err := mods.resolve([]string{"virtio_net", "bridge", "8021q", "virtio-net", "ext4"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, ko := range kos {
		names = append(names, modName(ko))
	}
	pos := func(n string) int {
		i := slices.Index(names, n)
		if i < 0 {
			t.Fatalf("%s missing from %v", n, names)
		}
		return i
	}
	for _, before := range [][2]string{
		{"virtio_ring", "virtio_net"}, {"virtio", "virtio_net"}, {"failover", "net_failover"},
		{"net_failover", "virtio_net"}, {"llc", "bridge"}, {"stp", "bridge"}, {"garp", "8021q"}, {"mrp", "8021q"},
	} {
		if pos(before[0]) > pos(before[1]) {
			t.Errorf("%s loads after %s: %v", before[0], before[1], names)
		}
	}
	if slices.Contains(names, "ext4") {
		t.Errorf("built-in ext4 listed for loading: %v", names)
	}
	if n := len(names) - len(slices.Compact(slices.Clone(names))); n != 0 {
		t.Errorf("duplicates in %v", names)
	}
	if _, err := mods.resolve([]string{"no_such_module"}); err == nil {
		t.Error("an unknown module resolved")
	}
}

// cpioNames lists the entries of a gzip-compressed newc archive.
func cpioNames(t *testing.T, path string) map[string]uint32 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	data, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]uint32{}
	align := func(n int) int { return (n + 3) &^ 3 }
	for off := 0; ; {
		if string(data[off:off+6]) != "070701" {
			t.Fatalf("bad cpio magic at %d", off)
		}
		field := func(i int) int {
			v, err := strconv.ParseUint(string(data[off+6+8*i:off+14+8*i]), 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return int(v)
		}
		mode, size, nameLen := field(1), field(6), field(11)
		name := string(data[off+110 : off+110+nameLen-1])
		if name == "TRAILER!!!" {
			return names
		}
		names[name] = uint32(mode)
		off = align(align(off+110+nameLen) + size)
	}
}

func TestInitramfsContentsAndCache(t *testing.T) {
	ctx := testContext(t)
	plain, err := Initramfs(ctx, Spec{})
	if err != nil {
		t.Fatal(err)
	}
	names := cpioNames(t, plain)
	for _, want := range []string{"init", "bin/busybox", "sbin/acpid", "dev/console", "etc/inittab",
		"etc/nodevirt/boot", "etc/acpi/PWRF/00000080"} {
		if _, ok := names[want]; !ok {
			t.Errorf("default initramfs lacks %s", want)
		}
	}
	if names["dev/console"]&0o170000 != modeChar {
		t.Errorf("dev/console is not a character device: mode %o", names["dev/console"])
	}
	if again, err := Initramfs(ctx, Spec{}); err != nil || again != plain {
		t.Errorf("same spec gave %s, %v; want the cached %s", again, err, plain)
	}

	ipPath, err := exec.LookPath("ip")
	if err != nil {
		t.Fatalf("iproute2's ip: %v", err)
	}
	custom, err := Initramfs(ctx, Spec{
		Files:   map[string]string{ipPath: "/usr/sbin/ip"},
		Modules: []string{"bridge"},
		Init:    "echo custom",
	})
	if err != nil {
		t.Fatal(err)
	}
	if custom == plain {
		t.Fatal("a different spec gave the same initramfs")
	}
	names = cpioNames(t, custom)
	var libc, loader bool
	for n := range names {
		libc = libc || strings.HasSuffix(n, "/libc.so.6")
		loader = loader || n == "lib64/ld-linux-x86-64.so.2"
	}
	if _, ok := names["usr/sbin/ip"]; !ok || !libc || !loader {
		t.Errorf("added binary, libc or loader missing: ip=%t libc=%t loader=%t", ok, libc, loader)
	}
	for _, want := range []string{"etc/nodevirt/init", "lib/modules/" + kernelRelease(t) + "/bridge.ko",
		"lib/modules/" + kernelRelease(t) + "/stp.ko"} {
		if _, ok := names[want]; !ok {
			t.Errorf("custom initramfs lacks %s", want)
		}
	}
}

func kernelRelease(t *testing.T) string {
	_, modulesDir, err := Kernel(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Base(modulesDir)
}

func TestCacheBuildsOnceUnderConcurrency(t *testing.T) {
	c := &cache{dir: t.TempDir()}
	var builds atomic.Int32
	var wg sync.WaitGroup
	paths := make([]string, 4)
	errs := make([]error, 4)
	for i := range paths {
		wg.Go(func() {
			paths[i], errs[i] = c.build(t.Context(), "thing", func(tmp string) error {
				builds.Add(1)
				time.Sleep(200 * time.Millisecond)
				return os.WriteFile(tmp, []byte("made"), 0o644)
			})
		})
	}
	wg.Wait()
	for i := range paths {
		if errs[i] != nil || paths[i] != c.path("thing") {
			t.Errorf("build %d: %s, %v", i, paths[i], errs[i])
		}
	}
	if n := builds.Load(); n != 1 {
		t.Errorf("artefact built %d times, want once", n)
	}

	// A failed build leaves nothing behind and is retried next time.
	boom := errors.New("boom")
	if _, err := c.build(t.Context(), "broken", func(tmp string) error {
		os.WriteFile(tmp, []byte("half"), 0o644)
		return boom
	}); !errors.Is(err, boom) {
		t.Fatalf("failed build returned %v", err)
	}
	if left, _ := filepath.Glob(c.path("*broken*")); len(left) != 0 {
		t.Errorf("failed build left %v", left)
	}

	// A held lock makes a builder wait, until its context ends.
	unlock, err := c.lock(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	if _, err := c.build(ctx, "other", func(tmp string) error { return os.WriteFile(tmp, nil, 0o644) }); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("build under a held lock returned %v, want a deadline error", err)
	}
	unlock()
}

func TestMissingToolNamesPackage(t *testing.T) {
	saved := requirements
	t.Cleanup(func() { requirements = saved })
	requirements = append(slices.Clone(saved), requirement{"/nonexistent/nodevirt-tool", "nodevirt-tool-pkg", "testing"})
	_, err := need("/nonexistent/nodevirt-tool")
	if err == nil || !strings.Contains(err.Error(), "install Debian package nodevirt-tool-pkg") {
		t.Errorf("missing tool error = %v", err)
	}
	if !slices.Contains(Requirements(), "busybox-static") || !slices.Contains(Requirements(), "extlinux") {
		t.Errorf("Requirements() = %v", Requirements())
	}
}

func volumeID(t *testing.T, iso string) string {
	t.Helper()
	b, err := os.ReadFile(iso)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) < 32840 || string(b[32769:32774]) != "CD001" {
		t.Fatalf("%s is not an ISO9660 image", iso)
	}
	return strings.TrimSpace(string(b[32808:32840]))
}

func TestSeedVolumeIDs(t *testing.T) {
	dir := t.TempDir()
	nc, err := NoCloudSeed(dir, "#cloud-config\n", "", "version: 2\n")
	if err != nil {
		t.Fatal(err)
	}
	if id := volumeID(t, nc); id != "cidata" {
		t.Errorf("NoCloud volume id %q", id)
	}
	cd, err := ConfigDriveSeed(dir, "#!/bin/sh\n", "", "")
	if err != nil {
		t.Fatal(err)
	}
	if id := volumeID(t, cd); id != "config-2" {
		t.Errorf("config drive volume id %q", id)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".seed-*")); len(left) != 0 {
		t.Errorf("staging left behind: %v", left)
	}
}

func TestBootDiskLayoutAndQCOW2(t *testing.T) {
	ctx := testContext(t)
	raw, err := BootDisk(ctx, DiskSpec{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 64<<20 {
		t.Errorf("disk is %d bytes, want 64 MiB", len(b))
	}
	if !bytes.Equal(b[510:512], []byte{0x55, 0xaa}) || b[446] != 0x80 || b[450] != 0x83 {
		t.Errorf("no active Linux partition in the MBR")
	}
	if again, err := BootDisk(ctx, DiskSpec{SizeMiB: 64}); err != nil || again != raw {
		t.Errorf("same spec gave %s, %v; want the cached %s", again, err, raw)
	}
	q, err := QCOW2(ctx, raw)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(ctx, "qemu-img", "info", "--output=json", q).Output()
	if err != nil {
		t.Fatal(err)
	}
	var info struct {
		Format      string `json:"format"`
		VirtualSize int64  `json:"virtual-size"`
	}
	if err := json.Unmarshal(out, &info); err != nil {
		t.Fatal(err)
	}
	if info.Format != "qcow2" || info.VirtualSize != 64<<20 {
		t.Errorf("qcow2 image: %+v", info)
	}
}

// helperEnv makes the test binary, re-run by TestCacheLockAcrossProcesses,
// act as a second process building into the same cache.
const helperEnv = "NODEVIRT_GUEST_TEST_HELPER_CACHE"

func TestCacheLockAcrossProcesses(t *testing.T) {
	if dir := os.Getenv(helperEnv); dir != "" {
		buildCounted(t, dir)
		return
	}
	dir := t.TempDir()
	helper := exec.Command(os.Args[0], "-test.run=^TestCacheLockAcrossProcesses$")
	helper.Env = append(os.Environ(), helperEnv+"="+dir)
	var out bytes.Buffer
	helper.Stdout, helper.Stderr = &out, &out
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	buildCounted(t, dir)
	if err := helper.Wait(); err != nil {
		t.Fatalf("helper process: %v: %s", err, out.String())
	}
	b, err := os.ReadFile(filepath.Join(dir, "builds"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), "\n"); n != 1 {
		t.Errorf("two processes built the artefact %d times, want once", n)
	}
}

// buildCounted builds one slow artefact, noting each real build in dir/builds.
func buildCounted(t *testing.T, dir string) {
	c := &cache{dir: dir}
	p, err := c.build(t.Context(), "shared", func(tmp string) error {
		f, err := os.OpenFile(filepath.Join(dir, "builds"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		fmt.Fprintln(f, os.Getpid())
		f.Close()
		time.Sleep(500 * time.Millisecond)
		return os.WriteFile(tmp, []byte("made"), 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(p); err != nil || string(b) != "made" {
		t.Fatalf("artefact %s: %q, %v", p, b, err)
	}
}
