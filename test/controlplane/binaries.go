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
		if exists(target.out) {
			continue
		}
		tmp := target.out + ".building"
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", tmp, target.pkg)
		cmd.Dir = mod
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off")
		if out, err := cmd.CombinedOutput(); err != nil {
			return Binaries{}, fmt.Errorf("build %s: %w\n%s", target.pkg, err, out)
		}
		if err := os.Rename(tmp, target.out); err != nil {
			return Binaries{}, err
		}
	}
	return b, nil
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
