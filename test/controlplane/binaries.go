package controlplane

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Binaries locates the control-plane programs.
type Binaries struct {
	APIServer         string
	ControllerManager string
	Etcd              string
}

// DefaultCacheDir holds the built control plane, keyed by the tools module pin.
const DefaultCacheDir = "/var/cache/nodevirt/controlplane"

// toolsModule is the tools module's path inside the repository.
const toolsModule = "test/tools/controlplane"

// EnsureBinaries returns the kube-apiserver and kube-controller-manager built
// from the pinned k8s.io/kubernetes release, building them into cacheDir the
// first time a pin is seen. Concurrent callers wait for one build.
// NODEVIRT_CONTROLPLANE_BIN, when set, names a directory holding both.
func EnsureBinaries(ctx context.Context, cacheDir string) (Binaries, error) {
	etcd, err := exec.LookPath("etcd")
	if err != nil {
		return Binaries{}, fmt.Errorf("etcd not found: install the Debian package etcd-server: %w", err)
	}
	if dir := os.Getenv("NODEVIRT_CONTROLPLANE_BIN"); dir != "" {
		return Binaries{filepath.Join(dir, "kube-apiserver"), filepath.Join(dir, "kube-controller-manager"), etcd}, nil
	}
	if cacheDir == "" {
		cacheDir = DefaultCacheDir
	}
	root, err := RepoRoot()
	if err != nil {
		return Binaries{}, err
	}
	mod := filepath.Join(root, toolsModule)
	key, err := PinKey(mod)
	if err != nil {
		return Binaries{}, err
	}
	dir := filepath.Join(cacheDir, key)
	b := Binaries{filepath.Join(dir, "kube-apiserver"), filepath.Join(dir, "kube-controller-manager"), etcd}
	if exists(b.APIServer) && exists(b.ControllerManager) {
		return b, nil
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return Binaries{}, err
	}
	lock, err := os.OpenFile(filepath.Join(cacheDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return Binaries{}, err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return Binaries{}, fmt.Errorf("lock %s: %w", cacheDir, err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Binaries{}, err
	}
	for _, target := range []struct{ pkg, out string }{
		{"k8s.io/kubernetes/cmd/kube-apiserver", b.APIServer},
		{"k8s.io/kubernetes/cmd/kube-controller-manager", b.ControllerManager},
	} {
		if err := buildCommand(ctx, mod, target.pkg, target.out); err != nil {
			return Binaries{}, err
		}
	}
	return b, nil
}

// NodeBinaries are the programs of a worker node with a kubelet.
type NodeBinaries struct {
	Kubelet   string
	Scheduler string
}

// EnsureNodeBinaries returns kubelet and kube-scheduler built from the same
// pin as EnsureBinaries' programs, building them into cacheDir once.
func EnsureNodeBinaries(ctx context.Context, cacheDir string) (NodeBinaries, error) {
	if cacheDir == "" {
		cacheDir = DefaultCacheDir
	}
	root, err := RepoRoot()
	if err != nil {
		return NodeBinaries{}, err
	}
	mod := filepath.Join(root, toolsModule)
	key, err := PinKey(mod)
	if err != nil {
		return NodeBinaries{}, err
	}
	dir := filepath.Join(cacheDir, key)
	b := NodeBinaries{filepath.Join(dir, "kubelet"), filepath.Join(dir, "kube-scheduler")}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return NodeBinaries{}, err
	}
	lock, err := os.OpenFile(filepath.Join(cacheDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return NodeBinaries{}, err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return NodeBinaries{}, fmt.Errorf("lock %s: %w", cacheDir, err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)
	for _, target := range []struct{ pkg, out string }{
		{"k8s.io/kubernetes/cmd/kubelet", b.Kubelet},
		{"k8s.io/kubernetes/cmd/kube-scheduler", b.Scheduler},
	} {
		if err := buildCommand(ctx, mod, target.pkg, target.out); err != nil {
			return NodeBinaries{}, err
		}
	}
	return b, nil
}

// buildCommand builds pkg of the tools module mod into out unless it is
// there, stamped with the pinned release's version (unstamped Kubernetes
// binaries report v0.0.0-master+$Format:%H$, which kubectl version refuses).
func buildCommand(ctx context.Context, mod, pkg, out string) error {
	if exists(out) {
		return nil
	}
	version, err := pinnedVersion(mod)
	if err != nil {
		return err
	}
	major, minor, _ := strings.Cut(strings.TrimPrefix(version, "v"), ".")
	minor, _, _ = strings.Cut(minor, ".")
	const v = "k8s.io/component-base/version"
	ldflags := fmt.Sprintf("-s -w -X %s.gitVersion=%s -X %s.gitMajor=%s -X %s.gitMinor=%s -X %s.gitTreeState=clean",
		v, version, v, major, v, minor, v)
	tmp := out + ".building"
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags="+ldflags, "-o", tmp, pkg)
	cmd.Dir = mod
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off")
	if o, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build %s: %w\n%s", pkg, err, o)
	}
	return os.Rename(tmp, out)
}

// pinnedVersion is the k8s.io/kubernetes version the tools module requires.
func pinnedVersion(mod string) (string, error) {
	data, err := os.ReadFile(filepath.Join(mod, "go.mod"))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && (f[0] == "k8s.io/kubernetes" || (len(f) >= 3 && f[0] == "require" && f[1] == "k8s.io/kubernetes")) {
			if f[0] == "require" {
				return f[2], nil
			}
			return f[1], nil
		}
	}
	return "", fmt.Errorf("%s/go.mod requires no k8s.io/kubernetes", mod)
}

// PinKey names a build of a tools module (a directory with go.mod and
// go.sum) by a hash of those two files, so a cache rebuilds only when the
// pin changes.
func PinKey(mod string) (string, error) {
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum"} {
		data, err := os.ReadFile(filepath.Join(mod, f))
		if err != nil {
			return "", fmt.Errorf("read pin of %s: %w", mod, err)
		}
		h.Write(data)
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// RepoRoot finds the nodevirt repository from the working directory, or from
// NODEVIRT_ROOT when set.
func RepoRoot() (string, error) {
	if r := os.Getenv("NODEVIRT_ROOT"); r != "" {
		return r, nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.HasPrefix(string(data), "module github.com/nodevirt/nodevirt\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("nodevirt repository not found above the working directory")
		}
		dir = parent
	}
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
