// Package netguest boots a throwaway QEMU (TCG) guest running Debian's cloud
// kernel — which, unlike the build machines' kernel, has bridge VLAN
// filtering, 802.1Q and nf_tables for bridges — from a busybox initramfs that
// carries the CNI plugin, a cnitool-style driver, iproute2 and nft, runs a
// shell test inside and reports its verdict over the serial console.
package netguest

import (
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// DefaultCacheDir keeps the unpacked kernel between runs.
const DefaultCacheDir = "/var/cache/nodevirt/netguest"

const kernelMeta = "linux-image-cloud-amd64"

func run(ctx context.Context, dir, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// Kernel returns the cloud kernel image and its lib/modules/<version>
// directory, fetching the package linux-image-cloud-amd64 depends on with
// apt-get download and unpacking it with dpkg -x into cacheDir on first use.
func Kernel(ctx context.Context, cacheDir string) (vmlinuz, modDir string, err error) {
	pkg, perr := kernelPackage(ctx)
	if perr != nil {
		// No package lists: use whatever kernel is cached.
		dirs, _ := filepath.Glob(filepath.Join(cacheDir, "linux-image-*"))
		sort.Strings(dirs)
		if len(dirs) == 0 {
			return "", "", fmt.Errorf("kernel: %w", perr)
		}
		return kernelPaths(dirs[len(dirs)-1])
	}
	dir := filepath.Join(cacheDir, pkg)
	if k, m, err := kernelPaths(dir); err == nil {
		return k, m, nil
	}
	tmp := dir + ".tmp"
	_ = os.RemoveAll(tmp)
	if err := os.MkdirAll(filepath.Join(tmp, "deb"), 0o755); err != nil {
		return "", "", err
	}
	// apt drops to the _apt user for downloads; it cannot write here.
	if _, err := run(ctx, filepath.Join(tmp, "deb"), "apt-get", "-q", "-o", "APT::Sandbox::User=root", "download", pkg); err != nil {
		return "", "", err
	}
	debs, _ := filepath.Glob(filepath.Join(tmp, "deb", "*.deb"))
	if len(debs) != 1 {
		return "", "", fmt.Errorf("apt-get download %s gave %d packages", pkg, len(debs))
	}
	if _, err := run(ctx, "", "dpkg", "-x", debs[0], tmp); err != nil {
		return "", "", err
	}
	if err := os.RemoveAll(filepath.Join(tmp, "deb")); err != nil {
		return "", "", err
	}
	_ = os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return "", "", err
	}
	return kernelPaths(dir)
}

func kernelPackage(ctx context.Context) (string, error) {
	out, err := run(ctx, "", "apt-cache", "depends", kernelMeta)
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") {
			return f[1], nil
		}
	}
	return "", fmt.Errorf("apt-cache depends %s names no kernel package", kernelMeta)
}

func kernelPaths(dir string) (string, string, error) {
	k, _ := filepath.Glob(filepath.Join(dir, "boot", "vmlinuz-*"))
	m, _ := filepath.Glob(filepath.Join(dir, "lib", "modules", "*"))
	if len(k) != 1 || len(m) != 1 {
		return "", "", fmt.Errorf("%s: %d kernels, %d module trees", dir, len(k), len(m))
	}
	return k[0], m[0], nil
}

// ModuleOrder returns the .ko files for names and everything they depend
// on (modinfo depends=), dependencies first, as insmod needs them.
func ModuleOrder(modDir string, names ...string) ([]string, error) {
	paths := map[string]string{}
	err := filepath.WalkDir(filepath.Join(modDir, "kernel"), func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasSuffix(p, ".ko") {
			paths[normMod(p)] = p
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("index modules: %w", err)
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(modDir, "modules.builtin")); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			builtin[normMod(l)] = true
		}
	}
	var order []string
	done := map[string]bool{}
	var visit func(n string, depth int) error
	visit = func(n string, depth int) error {
		n = normMod(n)
		if done[n] || builtin[n] {
			return nil
		}
		if depth > 32 {
			return fmt.Errorf("module dependency loop at %s", n)
		}
		p, ok := paths[n]
		if !ok {
			return fmt.Errorf("module %s not found in %s", n, modDir)
		}
		deps, err := moduleDepends(p)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d, depth+1); err != nil {
				return err
			}
		}
		done[n] = true
		order = append(order, p)
		return nil
	}
	for _, n := range names {
		if err := visit(n, 0); err != nil {
			return nil, err
		}
	}
	return order, nil
}

func normMod(s string) string {
	return strings.ReplaceAll(strings.TrimSuffix(filepath.Base(strings.TrimSpace(s)), ".ko"), "-", "_")
}

func moduleDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open module %s: %w", path, err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, nil
	}
	data, err := sec.Data()
	if err != nil {
		return nil, err
	}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if v, ok := strings.CutPrefix(string(kv), "depends="); ok && v != "" {
			return strings.Split(v, ","), nil
		}
	}
	return nil, nil
}
