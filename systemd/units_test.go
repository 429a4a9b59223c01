package systemd

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nodevirt/nodevirt/test/controlplane"
)

// unit is a parsed unit file: every Key=value of every section, in order.
type unit map[string][]string

func parseUnit(t *testing.T, path string) unit {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	u := unit{}
	section, line := "", ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		text := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(text, "#") || (text == "" && line == "") {
			continue
		}
		if strings.HasSuffix(text, "\\") {
			line += strings.TrimSuffix(text, "\\") + " "
			continue
		}
		line += text
		switch {
		case strings.HasPrefix(line, "["):
			section = strings.Trim(line, "[]")
		case strings.Contains(line, "="):
			k, v, _ := strings.Cut(line, "=")
			u[section+"."+k] = append(u[section+"."+k], v)
		}
		line = ""
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return u
}

func (u unit) get(key string) string {
	v := u[key]
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

func (u unit) words(key string) []string {
	var out []string
	for _, v := range u[key] {
		out = append(out, strings.Fields(v)...)
	}
	return out
}

// TestUnitsVerify installs the units as `make install-units` does into a
// throwaway root that also holds the programs they start (the built daemons,
// the cached control plane, the host's etcd) and the host's own system
// units, and runs `systemd-analyze verify` on each: syntax, dependencies,
// executables. It then checks what verify does not: every file a unit names
// is installed, and the names the units order themselves by are shipped.
func TestUnitsVerify(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed")
	}
	repo, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if out, err := exec.Command("make", "-C", repo, "--no-print-directory", "install-units", "DESTDIR="+root).CombinedOutput(); err != nil {
		t.Fatalf("make install-units: %v\n%s", err, out)
	}
	units, err := filepath.Glob(filepath.Join(root, "etc/systemd/system/*.service"))
	if err != nil || len(units) != 5 {
		t.Fatalf("installed units: %v %v", units, err)
	}
	bin := filepath.Join(root, "usr/local/bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	build := exec.Command("go", "build", "-o", bin+"/", "./nodeagent/cmd/nodeagent", "./clusterbrain/cmd/clusterbrain")
	build.Dir = repo
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cp, err := controlplane.EnsureBinaries(t.Context(), "")
	if err != nil {
		t.Fatal(err)
	}
	place(t, cp.APIServer, filepath.Join(bin, "kube-apiserver"))
	place(t, cp.ControllerManager, filepath.Join(bin, "kube-controller-manager"))
	place(t, cp.Etcd, filepath.Join(root, "usr/bin/etcd"))
	copyDir(t, "/lib/systemd/system", filepath.Join(root, "usr/lib/systemd/system"))

	names := map[string]bool{}
	for _, u := range units {
		names[filepath.Base(u)] = true
	}
	for _, path := range units {
		name := filepath.Base(path)
		t.Run(name, func(t *testing.T) {
			out, err := exec.Command(analyze, "verify", "--man=no", "--root="+root, name).CombinedOutput()
			if err != nil || len(strings.TrimSpace(string(out))) > 0 {
				t.Fatalf("systemd-analyze verify %s: %v\n%s", name, err, out)
			}
			u := parseUnit(t, path)
			for _, doc := range u.words("Unit.Documentation") {
				file, ok := strings.CutPrefix(doc, "file:")
				if !ok {
					continue
				}
				if _, err := os.Stat(filepath.Join(root, strings.TrimPrefix(file, "//"))); err != nil {
					t.Errorf("Documentation %s is not installed: %v", doc, err)
				}
			}
			if len(u.words("Unit.Documentation")) == 0 {
				t.Error("no Documentation=")
			}
			for _, env := range u["Service.EnvironmentFile"] {
				if strings.HasPrefix(env, "-") {
					t.Errorf("EnvironmentFile %s is optional: the installed configuration must be read", env)
				}
				if _, err := os.Stat(filepath.Join(root, env)); err != nil {
					t.Errorf("EnvironmentFile %s is not installed: %v", env, err)
				}
			}
			for _, key := range []string{"Unit.After", "Unit.Requires", "Unit.Wants"} {
				for _, dep := range u.words(key) {
					if strings.HasPrefix(dep, "nodevirt-") && !names[dep] {
						t.Errorf("%s=%s names no shipped unit", key, dep)
					}
					if strings.HasPrefix(dep, "kube-") {
						t.Errorf("%s=%s: the shipped units are nodevirt-kube-*", key, dep)
					}
				}
			}
			if u.get("Service.NoNewPrivileges") != "yes" {
				t.Error("NoNewPrivileges is not set")
			}
			if u.get("Service.OOMScoreAdjust") == "" {
				t.Error("no OOMScoreAdjust")
			}
		})
	}

	agent := parseUnit(t, filepath.Join(root, "etc/systemd/system/nodevirt-nodeagent.service"))
	if got := agent.get("Service.KillMode"); got != "process" {
		t.Errorf("nodeagent KillMode=%q: guests would die with the agent", got)
	}
	for _, key := range []string{"Service.ProtectSystem", "Service.ProtectHome", "Service.PrivateTmp", "Service.PrivateDevices"} {
		if v := agent.get(key); v != "" && v != "no" {
			t.Errorf("nodeagent %s=%s gives it a private mount namespace: its mounts and files would not be QEMU's", key, v)
		}
	}
	brain := parseUnit(t, filepath.Join(root, "etc/systemd/system/nodevirt-clusterbrain.service"))
	if !contains(brain.words("Unit.After"), "nodevirt-kube-apiserver.service") {
		t.Error("the brain is not ordered after nodevirt-kube-apiserver.service")
	}
	// The brain lists the machine's addresses over netlink; without it its
	// upload and subresources roles stop (seen in the Vagrant lab).
	if !contains(brain.words("Service.RestrictAddressFamilies"), "AF_NETLINK") {
		t.Error("the brain's RestrictAddressFamilies lacks AF_NETLINK")
	}
	for _, key := range []string{"Service.ProtectSystem", "Service.ProtectHome", "Service.PrivateTmp"} {
		if brain.get(key) == "" {
			t.Errorf("the brain lacks %s", key)
		}
	}
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// place hard-links (or copies) a program into the throwaway root: a
// symbolic link would point outside it.
func place(t *testing.T, src, dst string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(src, dst); err == nil {
		return
	}
	copyFile(t, src, dst, 0o755)
}

func copyFile(t *testing.T, src, dst string, mode os.FileMode) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// copyDir copies the regular files and symbolic links of one directory
// level (a systemd unit directory's layout).
func copyDir(t *testing.T, src, dst string) {
	t.Helper()
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		s, d := filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())
		switch {
		case e.Type()&os.ModeSymlink != 0:
			target, err := os.Readlink(s)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(target, d); err != nil {
				t.Fatal(err)
			}
		case e.Type().IsRegular():
			copyFile(t, s, d, 0o644)
		case e.IsDir():
			copyDir(t, s, d)
		}
	}
}
