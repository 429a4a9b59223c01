package imagearchive

import (
	"bufio"
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// HostPath returns where the host file p lives once the symlinks of its
// directories are resolved: on a merged-/usr system /lib/x86_64-linux-gnu/x
// becomes /usr/lib/x86_64-linux-gnu/x. The file itself may stay a symlink
// (its content is copied).
func HostPath(p string) (string, error) {
	dir, err := filepath.EvalSymlinks(filepath.Dir(p))
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, filepath.Base(p)), nil
}

// IsDynamicELF says whether p is an ELF file with a program interpreter
// (a dynamically linked executable) or a shared object.
func IsDynamicELF(p string) (bool, error) {
	raw, err := os.Open(p)
	if err != nil {
		return false, err
	}
	defer raw.Close()
	magic := make([]byte, len(elf.ELFMAG))
	if _, err := io.ReadFull(raw, magic); err != nil || string(magic) != elf.ELFMAG {
		return false, nil
	}
	f, err := elf.NewFile(raw)
	if err != nil {
		return false, fmt.Errorf("elf %s: %w", p, err)
	}
	if f.Type == elf.ET_DYN {
		return true, nil
	}
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return true, nil
		}
	}
	return false, nil
}

// SharedLibraries returns the host paths of every shared library bin loads,
// its program interpreter included, as the host's dynamic loader resolves
// them (ldd). A static binary has none.
func SharedLibraries(bin string) ([]string, error) {
	dyn, err := IsDynamicELF(bin)
	if err != nil || !dyn {
		return nil, err
	}
	out, err := exec.Command("ldd", bin).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w: %s", bin, err, bytes.TrimSpace(out))
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		// "libx.so.1 => /usr/lib/…/libx.so.1 (0x…)", "/lib64/ld-linux-x86-64.so.2 (0x…)",
		// "linux-vdso.so.1 (0x…)" (in the kernel, no file).
		if strings.Contains(line, "not found") {
			return nil, fmt.Errorf("ldd %s: %s", bin, line)
		}
		if _, after, ok := strings.Cut(line, "=> "); ok {
			line = after
		}
		p, _, _ := strings.Cut(line, " ")
		if strings.HasPrefix(p, "/") {
			libs = append(libs, p)
		}
	}
	return libs, sc.Err()
}

// DebianPackages maps each of paths to the Debian package (with its
// version) that installed it, for the files dpkg knows.
func DebianPackages(paths []string) (map[string]string, error) {
	if _, err := exec.LookPath("dpkg-query"); err != nil || len(paths) == 0 {
		return nil, nil
	}
	// dpkg records files under the paths its packages ship, which on a
	// merged-/usr system may be the unresolved ones: ask with both.
	var args []string
	for _, p := range paths {
		args = append(args, p)
		if c, err := HostPath(p); err == nil && c != p {
			args = append(args, c)
		}
		// Debian 12 ships many libraries under /lib/… while they live in /usr/lib/….
		if rest, ok := strings.CutPrefix(p, "/usr"); ok {
			args = append(args, rest)
		}
	}
	// Exit status 1 means some paths belong to no package: not an error.
	out, _ := exec.Command("dpkg-query", append([]string{"-S"}, args...)...).Output()
	owner := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		pkgs, file, ok := strings.Cut(sc.Text(), ": ")
		if !ok || strings.Contains(pkgs, ",") || strings.HasPrefix(pkgs, "diversion") {
			continue
		}
		owner[file] = strings.TrimSuffix(pkgs, ":amd64")
	}
	versions := map[string]string{}
	result := map[string]string{}
	for _, p := range paths {
		var pkg string
		for _, cand := range []string{p, strings.TrimPrefix(p, "/usr")} {
			if pkg = owner[cand]; pkg != "" {
				break
			}
		}
		if c, err := HostPath(p); pkg == "" && err == nil {
			pkg = owner[c]
		}
		if pkg == "" {
			continue
		}
		if _, ok := versions[pkg]; !ok {
			v, err := exec.Command("dpkg-query", "-W", "-f=${Version}", pkg).Output()
			if err != nil {
				return nil, fmt.Errorf("version of %s: %w", pkg, err)
			}
			versions[pkg] = string(v)
		}
		result[p] = pkg + "=" + versions[pkg]
	}
	return result, nil
}

// HostFiles returns image entries for the host files given (at their
// resolved HostPath) and, when withLibs, for every shared library they load,
// each once; sorted by path.
func HostFiles(paths []string, withLibs bool) ([]File, error) {
	seen := map[string]bool{}
	var files []File
	add := func(p string) error {
		hp, err := HostPath(p)
		if err != nil {
			return err
		}
		if seen[hp] {
			return nil
		}
		seen[hp] = true
		st, err := os.Stat(hp)
		if err != nil {
			return err
		}
		files = append(files, File{Path: hp, Source: hp, Mode: st.Mode().Perm()})
		return nil
	}
	for _, p := range paths {
		if err := add(p); err != nil {
			return nil, err
		}
		if !withLibs {
			continue
		}
		libs, err := SharedLibraries(p)
		if err != nil {
			return nil, err
		}
		for _, l := range libs {
			if err := add(l); err != nil {
				return nil, err
			}
		}
	}
	sort.Slice(files, func(i, j int) bool { return files[i].Path < files[j].Path })
	return files, nil
}
