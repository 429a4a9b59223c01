// Command nodevirt-image writes a container image archive from files, with
// no base image (package imagearchive): `make images` builds nodevirt's
// images with it.
//
//	nodevirt-image -o nodeagent.tar -name localhost/nodevirt/nodeagent:v1 \
//	  -add bin/nodeagent:/usr/local/bin/nodeagent -host /usr/sbin/nft -libs \
//	  -entrypoint /usr/local/bin/nodeagent
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/deploy/imagearchive"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "nodevirt-image:", err)
		os.Exit(1)
	}
}

func run() error {
	var names, adds, hosts, dirs, env, labels, entrypoint list
	out := flag.String("o", "", "archive to write")
	libs := flag.Bool("libs", false, "add the shared libraries every dynamically linked file loads (as the host resolves them)")
	mergedUsr := flag.Bool("merged-usr", false, "add /bin, /sbin, /lib and /lib64 as symlinks into /usr (Debian's layout)")
	etc := flag.Bool("etc", false, "add a minimal /etc/passwd and /etc/group (root and nobody), an empty /tmp and /run, and /var/run linked to it")
	created := flag.String("created", "", "creation time, RFC 3339 (default: SOURCE_DATE_EPOCH, else the Unix epoch)")
	contents := flag.String("contents", "/usr/share/doc/nodevirt/image-contents.txt", "where the image lists its files and their Debian packages (empty: nowhere)")
	flag.Var(&names, "name", "reference the image is imported as, repository:tag (repeatable)")
	flag.Var(&adds, "add", "SRC:DEST, a file copied into the image (repeatable)")
	flag.Var(&hosts, "host", "a host file (or a command on PATH) copied to its own path (repeatable)")
	flag.Var(&dirs, "dir", "an empty directory (repeatable)")
	flag.Var(&env, "env", "KEY=value in the image's environment (repeatable)")
	flag.Var(&labels, "label", "key=value image label (repeatable)")
	flag.Var(&entrypoint, "entrypoint", "entrypoint argument (repeatable, in order)")
	flag.Parse()
	if *out == "" {
		return fmt.Errorf("-o is required")
	}
	img := imagearchive.Image{Names: names, Entrypoint: entrypoint, Env: env, Labels: map[string]string{}}
	for _, l := range labels {
		k, v, _ := strings.Cut(l, "=")
		img.Labels[k] = v
	}
	var err error
	if img.Created, err = creationTime(*created); err != nil {
		return err
	}

	var hostPaths []string
	for _, h := range hosts {
		if !strings.Contains(h, "/") {
			p, err := exec.LookPath(h)
			if err != nil {
				return fmt.Errorf("-host %s: %w", h, err)
			}
			h = p
		}
		hostPaths = append(hostPaths, h)
	}
	var srcs []string
	for _, a := range adds {
		src, dest, ok := strings.Cut(a, ":")
		if !ok {
			return fmt.Errorf("-add %q: want SRC:DEST", a)
		}
		st, err := os.Stat(src)
		if err != nil {
			return err
		}
		img.Files = append(img.Files, imagearchive.File{Path: dest, Source: src, Mode: st.Mode().Perm()})
		srcs = append(srcs, src)
	}
	hostFiles, err := imagearchive.HostFiles(hostPaths, *libs)
	if err != nil {
		return err
	}
	if *libs {
		// Libraries of the added (non-host) files too.
		for _, s := range srcs {
			l, err := imagearchive.SharedLibraries(s)
			if err != nil {
				return err
			}
			more, err := imagearchive.HostFiles(l, false)
			if err != nil {
				return err
			}
			hostFiles = append(hostFiles, more...)
		}
		hostFiles = dedupe(hostFiles)
	}
	img.Files = append(img.Files, hostFiles...)
	for _, d := range dirs {
		img.Files = append(img.Files, imagearchive.File{Path: d, Dir: true})
	}
	if *mergedUsr {
		for _, l := range []string{"bin", "sbin", "lib", "lib64"} {
			img.Files = append(img.Files, imagearchive.File{Path: "/" + l, Link: "usr/" + l})
		}
	}
	if *etc {
		img.Files = append(img.Files,
			imagearchive.File{Path: "/etc/passwd", Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")},
			imagearchive.File{Path: "/etc/group", Data: []byte("root:x:0:\nnogroup:x:65534:\n")},
			imagearchive.File{Path: "/tmp", Dir: true, Mode: 0o1777},
			// Programs (libvirt's client among them) name /var/run.
			imagearchive.File{Path: "/run", Dir: true},
			imagearchive.File{Path: "/var/run", Link: "../run"})
	}
	if *contents != "" {
		list, err := contentsList(img.Files)
		if err != nil {
			return err
		}
		img.Files = append(img.Files, imagearchive.File{Path: *contents, Data: list})
	}

	f, err := os.Create(*out + ".tmp")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	s, err := imagearchive.Write(f, img)
	if err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), *out); err != nil {
		return err
	}
	fmt.Printf("%s: %s, %d files, layer %.1f MiB (%.1f MiB uncompressed), %s\n", filepath.Base(*out), strings.Join(names, " "),
		s.Files, float64(s.LayerSize)/(1<<20), float64(s.UncompressedSize)/(1<<20), s.ManifestDigest)
	return nil
}

// creationTime is the flag's time, else SOURCE_DATE_EPOCH's, else the epoch.
func creationTime(flagValue string) (time.Time, error) {
	if flagValue != "" {
		return time.Parse(time.RFC3339, flagValue)
	}
	if e := os.Getenv("SOURCE_DATE_EPOCH"); e != "" {
		var sec int64
		if _, err := fmt.Sscan(e, &sec); err != nil {
			return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", e, err)
		}
		return time.Unix(sec, 0), nil
	}
	return time.Unix(0, 0), nil
}

func dedupe(files []imagearchive.File) []imagearchive.File {
	seen := map[string]bool{}
	var out []imagearchive.File
	for _, f := range files {
		if !seen[f.Path] {
			seen[f.Path] = true
			out = append(out, f)
		}
	}
	return out
}

// contentsList is one line per file copied from the host or the build:
// its path in the image and, for host files, the Debian package and
// version it came from.
func contentsList(files []imagearchive.File) ([]byte, error) {
	var hostPaths []string
	for _, f := range files {
		if f.Source != "" {
			hostPaths = append(hostPaths, f.Source)
		}
	}
	pkgs, err := imagearchive.DebianPackages(hostPaths)
	if err != nil {
		return nil, err
	}
	var lines []string
	for _, f := range files {
		if f.Source == "" {
			continue
		}
		from := "built from the nodevirt repository"
		if p, ok := pkgs[f.Source]; ok {
			from = "debian " + p
		}
		lines = append(lines, f.Path+"\t"+from)
	}
	sort.Strings(lines)
	return []byte(strings.Join(lines, "\n") + "\n"), nil
}
