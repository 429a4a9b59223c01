package guest

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// KernelMetaPackage is the Debian package whose dependency names the kernel
// package the guests boot.
const KernelMetaPackage = "linux-image-cloud-amd64"

// Kernel returns the cloud kernel image and its modules directory
// (…/lib/modules/<version>), downloading and unpacking the kernel package
// into the cache the first time and whenever apt offers a newer one. When apt
// cannot say which kernel is current (no package lists), the newest kernel
// already in the cache is used.
func Kernel(ctx context.Context) (vmlinuz string, modulesDir string, err error) {
	c, err := openCache()
	if err != nil {
		return "", "", err
	}
	name, err := currentKernelName(ctx, c)
	if err != nil {
		cached, cerr := newestCachedKernel(c)
		if cerr != nil {
			return "", "", fmt.Errorf("kernel: %w", err)
		}
		slog.Warn("apt cannot name the current kernel; using the cached one", "error", err, "kernel", cached)
		return kernelPaths(c.path(cached))
	}
	dir, err := c.build(ctx, "kernel-"+name.pkg+"_"+sanitize(name.version), func(tmp string) error {
		return unpackKernel(ctx, tmp, name.pkg, name.version)
	})
	if err != nil {
		return "", "", fmt.Errorf("kernel: %w", err)
	}
	return kernelPaths(dir)
}

type kernelName struct{ pkg, version string }

// aptLists holds apt's package lists; their names, sizes and times key the
// remembered answer of currentKernelName, since apt-cache takes about a
// second per call here (no pkgcache).
const aptLists = "/var/lib/apt/lists"

// currentKernelName asks apt which kernel package the meta package depends on
// and which version of it would be installed. The answer is remembered in
// the cache until apt's package lists change.
func currentKernelName(ctx context.Context, c *cache) (kernelName, error) {
	k, sum := newKey()
	entries, err := os.ReadDir(aptLists)
	if err != nil {
		return kernelName{}, fmt.Errorf("apt package lists: %w", err)
	}
	for _, e := range entries {
		if info, err := e.Info(); err == nil && info.Mode().IsRegular() {
			k.add(e.Name(), fmt.Sprint(info.Size()), info.ModTime().String())
		}
	}
	memo := c.path("kernel-name-" + sum())
	if b, err := os.ReadFile(memo); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			return kernelName{pkg: f[0], version: f[1]}, nil
		}
	}
	name, err := askAptForKernel(ctx)
	if err != nil {
		return kernelName{}, err
	}
	tmp := memo + fmt.Sprintf(".tmp-%d", os.Getpid())
	if err := os.WriteFile(tmp, []byte(name.pkg+" "+name.version+"\n"), 0o644); err == nil {
		_ = os.Rename(tmp, memo)
	}
	return name, nil
}

func askAptForKernel(ctx context.Context) (kernelName, error) {
	out, err := run(ctx, "", "apt-cache", "show", "--no-all-versions", KernelMetaPackage)
	if err != nil {
		return kernelName{}, err
	}
	// "Depends: linux-image-6.1.0-56-cloud-amd64 (= 6.1.192-2)"
	for _, line := range strings.Split(out, "\n") {
		deps, ok := strings.CutPrefix(line, "Depends: ")
		if !ok {
			continue
		}
		for _, dep := range strings.Split(deps, ",") {
			f := strings.Fields(strings.NewReplacer("(", " ", ")", " ").Replace(dep))
			if len(f) == 3 && strings.HasPrefix(f[0], "linux-image-") && f[1] == "=" {
				return kernelName{pkg: f[0], version: f[2]}, nil
			}
		}
	}
	return kernelName{}, fmt.Errorf("apt-cache show %s names no exact linux-image dependency (run apt-get update?)", KernelMetaPackage)
}

func newestCachedKernel(c *cache) (string, error) {
	matches, err := filepath.Glob(c.path("kernel-linux-image-*"))
	if err != nil || len(matches) == 0 {
		return "", fmt.Errorf("no kernel in %s", c.dir)
	}
	sort.Slice(matches, func(i, j int) bool {
		a, _ := os.Stat(matches[i])
		b, _ := os.Stat(matches[j])
		return a.ModTime().After(b.ModTime())
	})
	return filepath.Base(matches[0]), nil
}

// unpackKernel downloads the kernel package with apt and unpacks it into dir.
func unpackKernel(ctx context.Context, dir, pkg, version string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	dl := filepath.Join(dir, "download")
	if err := os.MkdirAll(dl, 0o755); err != nil {
		return err
	}
	// apt drops to the _apt user for downloads, who cannot write here.
	if _, err := run(ctx, dl, "apt-get", "-q", "-o", "APT::Sandbox::User=root", "download", pkg+"="+version); err != nil {
		return err
	}
	debs, _ := filepath.Glob(filepath.Join(dl, "*.deb"))
	if len(debs) != 1 {
		return fmt.Errorf("apt-get download %s left %d .deb files", pkg, len(debs))
	}
	if _, err := run(ctx, "", "dpkg", "-x", debs[0], dir); err != nil {
		return err
	}
	return os.RemoveAll(dl)
}

func kernelPaths(dir string) (string, string, error) {
	kernels, _ := filepath.Glob(filepath.Join(dir, "boot", "vmlinuz-*"))
	mods, _ := filepath.Glob(filepath.Join(dir, "lib", "modules", "*"))
	if len(kernels) != 1 || len(mods) != 1 {
		return "", "", fmt.Errorf("kernel: %s holds %d kernels and %d module trees, want one of each", dir, len(kernels), len(mods))
	}
	return kernels[0], mods[0], nil
}

func sanitize(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '-', r == '_':
			return r
		}
		return '_'
	}, s)
}

// modules indexes the loadable modules of one kernel.
type modules struct {
	path    map[string]string // module name → .ko path
	builtin map[string]bool
}

// modName normalises a module name: the kernel treats - and _ alike.
func modName(s string) string {
	s = strings.TrimSuffix(filepath.Base(s), ".ko")
	return strings.ReplaceAll(s, "-", "_")
}

func indexModules(modulesDir string) (*modules, error) {
	m := &modules{path: map[string]string{}, builtin: map[string]bool{}}
	err := filepath.WalkDir(filepath.Join(modulesDir, "kernel"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			m.path[modName(p)] = p
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("index modules in %s: %w", modulesDir, err)
	}
	if b, err := os.ReadFile(filepath.Join(modulesDir, "modules.builtin")); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			m.builtin[modName(sc.Text())] = true
		}
	}
	return m, nil
}

// modinfo reads the key=value pairs of a module's .modinfo section.
func modinfo(path string) (map[string][]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("%s has no .modinfo section", path)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, err
	}
	info := map[string][]string{}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if k, v, ok := strings.Cut(string(kv), "="); ok {
			info[k] = append(info[k], v)
		}
	}
	return info, nil
}

// resolve returns the .ko files to insmod, in an order that loads every
// module after its dependencies (and its "softdep pre:" modules, when they
// are loadable). Built-in modules are left out; unknown names are an error.
func (m *modules) resolve(names []string) ([]string, error) {
	var order []string
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string, soft bool) error
	visit = func(name string, soft bool) error {
		name = modName(name)
		if m.builtin[name] || state[name] == 2 {
			return nil
		}
		if state[name] == 1 {
			return fmt.Errorf("module dependency cycle at %s", name)
		}
		p, ok := m.path[name]
		if !ok {
			if soft {
				return nil
			}
			return fmt.Errorf("kernel module %s not found", name)
		}
		state[name] = 1
		info, err := modinfo(p)
		if err != nil {
			return fmt.Errorf("module %s: %w", name, err)
		}
		for _, deps := range info["depends"] {
			for _, d := range strings.Split(deps, ",") {
				if d != "" {
					if err := visit(d, false); err != nil {
						return err
					}
				}
			}
		}
		for _, sd := range info["softdep"] {
			pre, _, _ := strings.Cut(sd, "post:")
			if pre, ok := strings.CutPrefix(strings.TrimSpace(pre), "pre:"); ok {
				for _, d := range strings.Fields(pre) {
					if err := visit(d, true); err != nil {
						return err
					}
				}
			}
		}
		state[name] = 2
		order = append(order, p)
		return nil
	}
	for _, n := range names {
		if err := visit(n, false); err != nil {
			return nil, err
		}
	}
	return order, nil
}
