package guest

import (
	"bufio"
	"compress/gzip"
	"context"
	"debug/elf"
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Spec describes what an initramfs holds beyond the default guest.
type Spec struct {
	// Files maps host paths to guest paths. A dynamically linked ELF file
	// brings its libraries and loader (as ldd finds them) along. Busybox's
	// shell prefers its own applets, so call added binaries by full path.
	Files map[string]string
	// Modules are kernel modules loaded after the default ones, in this
	// order; each module's dependencies are added and loaded before it.
	Modules []string
	// Init is a shell script body run after the standard boot (modules,
	// markers, seed, address) and before the console shell is offered. It
	// runs with the console as its output; start long-running work with &.
	// NODEVIRT-INIT-EXIT <status> is printed when it returns.
	Init string
	// GuestAgent adds Debian's QEMU guest agent (qemu-ga, package
	// qemu-guest-agent, with its libraries), the host's os-release (for
	// guest-get-osinfo) and a utmp with root logged in on ttyS0 since
	// AgentLoginTime (for guest-get-users). Boot links
	// /dev/virtio-ports/<name> for every virtio-serial port (no udev here),
	// starts qemu-ga on GuestAgentPort and prints
	// "NODEVIRT-AGENT-STARTED <device>", or NODEVIRT-AGENT-NO-PORT when the
	// machine has no such port.
	GuestAgent bool
}

// DefaultModules are loaded by every guest: virtio devices, disks and CD-ROMs
// on virtio-scsi and IDE, ISO9660 for seeds, and the ACPI power button.
var DefaultModules = []string{
	"virtio_pci", "virtio_blk", "virtio_net", "virtio_console", "virtio_scsi",
	"sd_mod", "ata_piix", "sr_mod", "isofs", "button", "evdev",
}

var (
	//go:embed rootfs/boot.sh
	bootScript []byte
	//go:embed rootfs/inittab
	inittab []byte
	//go:embed rootfs/profile
	profile []byte
	//go:embed rootfs/power-button.sh
	powerButton []byte
)

// Initramfs returns a gzip-compressed initramfs for the kernel from Kernel:
// busybox as init, the default boot described in the package documentation,
// and what spec adds.
func Initramfs(ctx context.Context, spec Spec) (string, error) {
	_, modulesDir, err := Kernel(ctx)
	if err != nil {
		return "", err
	}
	a, err := assemble(ctx, modulesDir, spec)
	if err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	k, sum := newKey()
	if err := a.describe(k); err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	c, err := openCache()
	if err != nil {
		return "", err
	}
	return c.build(ctx, "initramfs-"+sum()+".cpio.gz", func(tmp string) error {
		return writeArchive(tmp, a)
	})
}

func writeArchive(path string, a *archive) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	zw := gzip.NewWriter(f)
	if err := a.write(zw, os.ReadFile); err != nil {
		f.Close()
		return err
	}
	if err := zw.Close(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// assemble lays out the guest's files.
func assemble(ctx context.Context, modulesDir string, spec Spec) (*archive, error) {
	a := newArchive()
	for _, d := range []string{"dev", "proc", "sys", "run", "tmp", "mnt", "root", "var", "lib", "lib64",
		"bin", "sbin", "usr/bin", "usr/sbin", "etc/nodevirt"} {
		a.dir(d)
	}
	a.chardev("dev/console", 5, 1)
	a.chardev("dev/null", 1, 3)

	busybox, err := need("/bin/busybox")
	if err != nil {
		return nil, err
	}
	a.copy("bin/busybox", 0o755, busybox)
	applets, err := run(ctx, "", busybox, "--list-full")
	if err != nil {
		return nil, err
	}
	for _, p := range strings.Fields(applets) {
		if p != "bin/busybox" {
			a.symlink(p, "/bin/busybox")
		}
	}
	a.symlink("init", "/bin/busybox") // the kernel runs /init; busybox acts as init by name

	a.file("etc/inittab", 0o644, inittab)
	a.file("etc/profile", 0o644, profile)
	a.file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\n"))
	a.file("etc/group", 0o644, []byte("root:x:0:\n"))
	a.file("etc/hostname", 0o644, []byte("nodevirt-guest\n"))
	a.file("etc/nodevirt/boot", 0o755, bootScript)
	a.file("etc/acpi/PWRF/00000080", 0o755, powerButton)
	if spec.Init != "" {
		a.file("etc/nodevirt/init", 0o755, []byte(spec.Init+"\n"))
	}

	if spec.GuestAgent {
		if err := addGuestAgent(ctx, a); err != nil {
			return nil, err
		}
	}

	mods, err := indexModules(modulesDir)
	if err != nil {
		return nil, err
	}
	kos, err := mods.resolve(append(append([]string{}, DefaultModules...), spec.Modules...))
	if err != nil {
		return nil, err
	}
	var list strings.Builder
	for _, ko := range kos {
		guestPath := "/lib/modules/" + filepath.Base(modulesDir) + "/" + filepath.Base(ko)
		a.copy(guestPath, 0o644, ko)
		list.WriteString(guestPath + "\n")
	}
	a.file("etc/nodevirt/modules", 0o644, []byte(list.String()))

	hosts := make([]string, 0, len(spec.Files))
	for h := range spec.Files {
		hosts = append(hosts, h)
	}
	sort.Strings(hosts)
	for _, h := range hosts {
		if err := addHostFile(ctx, a, h, spec.Files[h]); err != nil {
			return nil, err
		}
	}
	return a, nil
}

// addHostFile copies one host file, and its shared libraries when it is a
// dynamically linked ELF executable.
func addHostFile(ctx context.Context, a *archive, host, guestPath string) error {
	real, err := filepath.EvalSymlinks(host)
	if err != nil {
		return fmt.Errorf("file %s: %w", host, err)
	}
	st, err := os.Stat(real)
	if err != nil {
		return fmt.Errorf("file %s: %w", host, err)
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("file %s: only regular files can be added", host)
	}
	if guestPath == "" {
		guestPath = host
	}
	a.copy(guestPath, uint32(st.Mode().Perm()), real)
	if !dynamicELF(real) {
		return nil
	}
	libs, err := sharedLibraries(ctx, real)
	if err != nil {
		return fmt.Errorf("file %s: %w", host, err)
	}
	for _, lib := range libs {
		libReal, err := filepath.EvalSymlinks(lib)
		if err != nil {
			return fmt.Errorf("file %s: library %w", host, err)
		}
		a.copy(lib, 0o755, libReal)
	}
	return nil
}

func dynamicELF(path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return true
		}
	}
	return false
}

// sharedLibraries lists the absolute paths ldd reports for a binary,
// including its program loader.
func sharedLibraries(ctx context.Context, path string) ([]string, error) {
	out, err := run(ctx, "", "ldd", path)
	if err != nil {
		return nil, err
	}
	var libs []string
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.Contains(line, "not found") {
			return nil, fmt.Errorf("ldd: %s", line)
		}
		if _, after, ok := strings.Cut(line, "=>"); ok {
			line = strings.TrimSpace(after)
		}
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], "/") {
			libs = append(libs, f[0])
		}
	}
	return libs, nil
}
