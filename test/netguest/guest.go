package netguest

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// VLANScript is the in-guest test of VLAN isolation, spoof check, DEL
// without netns and GC.
//
//go:embed vlan.sh
var VLANScript []byte

// Console markers the guest prints.
const (
	PassMarker = "NETGUEST PASS"
	FailMarker = "NETGUEST FAIL"
	doneMarker = "NETGUEST-DONE"
)

// Modules the test needs; their dependencies are added by ModuleOrder.
var Modules = []string{"veth", "bridge", "8021q", "nf_tables", "nft_meta_bridge"}

// Tools are host binaries copied into the guest (guest path → host path),
// with their shared libraries.
var Tools = map[string]string{
	"/usr/sbin/ip":     "/usr/sbin/ip",
	"/usr/sbin/bridge": "/usr/sbin/bridge",
	"/usr/sbin/nft":    "/usr/sbin/nft",
	"/cni/static":      "/usr/lib/cni/static",
	"/cni/host-local":  "/usr/lib/cni/host-local",
}

const busybox = "/bin/busybox" // from busybox-static

const initScript = `#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mkdir -p /run/netns /var/run
for m in $(cat /etc/modules.order); do insmod "$m" || echo "insmod $m failed"; done
echo "netguest: kernel $(uname -r), modules loaded"
sh /test.sh
echo ` + doneMarker + `
poweroff -f
`

// Image is a bootable kernel + initramfs pair.
type Image struct {
	Kernel string
	Initrd string
}

// Spec says what goes into the initramfs.
type Spec struct {
	CacheDir string            // kernel cache, DefaultCacheDir when empty
	WorkDir  string            // where the initramfs is written
	Binaries map[string]string // guest path → host path (static Go binaries)
	Script   []byte            // run as /test.sh
}

// Build fetches the kernel and assembles the initramfs.
func Build(ctx context.Context, s Spec) (*Image, error) {
	if s.CacheDir == "" {
		s.CacheDir = DefaultCacheDir
	}
	kernel, modDir, err := Kernel(ctx, s.CacheDir)
	if err != nil {
		return nil, err
	}
	mods, err := ModuleOrder(modDir, Modules...)
	if err != nil {
		return nil, err
	}
	root := filepath.Join(s.WorkDir, "root")
	if err := os.RemoveAll(root); err != nil {
		return nil, err
	}
	for _, d := range []string{"bin", "dev", "etc", "proc", "sys", "run", "tmp", "lib/modules", "usr/sbin", "cni", "var"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return nil, err
		}
	}
	if _, err := run(ctx, "", "mknod", filepath.Join(root, "dev/console"), "c", "5", "1"); err != nil {
		return nil, err
	}
	files := map[string]string{"/bin/busybox": busybox}
	for g, h := range Tools {
		files[g] = h
	}
	for g, h := range s.Binaries {
		files[g] = h
	}
	var order []string
	for _, m := range mods {
		g := "/lib/modules/" + filepath.Base(m)
		files[g] = m
		order = append(order, g)
	}
	for g, h := range files {
		if err := copyFile(h, filepath.Join(root, g), 0o755); err != nil {
			return nil, err
		}
		if err := copyLibs(ctx, h, root); err != nil {
			return nil, err
		}
	}
	writes := map[string][]byte{
		"init":              []byte(initScript),
		"test.sh":           s.Script,
		"etc/modules.order": []byte(strings.Join(order, "\n") + "\n"),
	}
	for p, b := range writes {
		if err := os.WriteFile(filepath.Join(root, p), b, 0o755); err != nil {
			return nil, err
		}
	}
	initrd := filepath.Join(s.WorkDir, "initrd.cpio")
	cmd := exec.CommandContext(ctx, "sh", "-c", "find . | cpio -o -H newc --quiet > "+initrd)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("cpio: %w: %s", err, out)
	}
	return &Image{Kernel: kernel, Initrd: initrd}, os.RemoveAll(root)
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// copyLibs copies the shared libraries (and loader) a dynamically linked
// binary needs, as ldd lists them, to the same paths under root.
func copyLibs(ctx context.Context, bin, root string) error {
	if strings.HasSuffix(bin, ".ko") {
		return nil
	}
	out, err := exec.CommandContext(ctx, "ldd", bin).CombinedOutput()
	if err != nil {
		return nil // static binaries make ldd fail
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		for _, f := range strings.Fields(sc.Text()) {
			if !strings.HasPrefix(f, "/") {
				continue
			}
			real, err := filepath.EvalSymlinks(f)
			if err != nil {
				return err
			}
			if err := copyFile(real, filepath.Join(root, f), 0o755); err != nil {
				return err
			}
		}
	}
	return nil
}

// Boot runs the image under QEMU TCG and returns the serial console output
// once the guest says it is done (or powers off). A missing marker or an
// expired ctx is an error carrying the console so far.
func Boot(ctx context.Context, img *Image) (string, error) {
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64",
		"-accel", "tcg", "-m", "512", "-smp", "1", "-nodefaults", "-no-reboot",
		"-display", "none", "-serial", "stdio",
		"-kernel", img.Kernel, "-initrd", img.Initrd,
		"-append", "console=ttyS0 panic=-1 quiet loglevel=3")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", err
	}
	var mu sync.Mutex
	var console bytes.Buffer
	cmd.Stderr = &lockedWriter{mu: &mu, w: &console}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("start qemu: %w", err)
	}
	done := false
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		mu.Lock()
		console.WriteString(sc.Text() + "\n")
		mu.Unlock()
		if strings.Contains(sc.Text(), doneMarker) {
			done = true
			break
		}
	}
	if done {
		_ = cmd.Process.Kill()
	}
	werr := cmd.Wait()
	mu.Lock()
	out := console.String()
	mu.Unlock()
	if !done {
		if ctx.Err() != nil {
			return out, fmt.Errorf("guest did not finish: %w", ctx.Err())
		}
		return out, fmt.Errorf("guest stopped before finishing: %v", werr)
	}
	return out, nil
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// Verdict reads the test's verdict from the console.
func Verdict(console string) error {
	switch {
	case strings.Contains(console, PassMarker):
		return nil
	case strings.Contains(console, FailMarker):
		i := strings.Index(console, FailMarker)
		return errors.New(strings.SplitN(console[i:], "\n", 2)[0])
	}
	return errors.New("guest printed no verdict")
}

// BootTimeout bounds one guest run under TCG.
const BootTimeout = 4 * time.Minute
