// Package upstreamvirtctl builds KubeVirt's own virtctl from the release
// pinned in test/tools/virtctl, so that tests can check nodevirt against the
// client users already have. The binary is built once per pin into a cache
// directory shared by every test process of the machine.
package upstreamvirtctl

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nodevirt/nodevirt/test/controlplane"
)

// DefaultCacheDir holds the built binaries, one directory per pin.
const DefaultCacheDir = "/var/cache/nodevirt/virtctl"

// EnvBinary, when set, names a virtctl binary to use instead of building one.
const EnvBinary = "NODEVIRT_UPSTREAM_VIRTCTL"

const (
	toolsModule = "test/tools/virtctl"
	module      = "kubevirt.io/kubevirt"
	mainPackage = module + "/cmd/virtctl"
	versionPkg  = "kubevirt.io/client-go/version"
)

// Binary returns the path of upstream virtctl built from the pinned
// release, building it into DefaultCacheDir the first time the pin is seen.
func Binary(ctx context.Context) (string, error) {
	return BinaryIn(ctx, DefaultCacheDir)
}

// BinaryIn is Binary with the cache in cacheDir. Concurrent callers, in
// this process or others, wait for a single build.
func BinaryIn(ctx context.Context, cacheDir string) (string, error) {
	if bin := os.Getenv(EnvBinary); bin != "" {
		return bin, nil
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		return "", err
	}
	mod := filepath.Join(root, toolsModule)
	key, err := controlplane.PinKey(mod)
	if err != nil {
		return "", err
	}
	bin := filepath.Join(cacheDir, key, "virtctl")
	if exists(bin) {
		return bin, nil
	}
	if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(filepath.Join(cacheDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := flock(ctx, lock); err != nil {
		return "", fmt.Errorf("lock %s: %w", cacheDir, err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN)
	if exists(bin) { // another process built it while we waited
		return bin, nil
	}
	version, err := PinnedVersion(mod)
	if err != nil {
		return "", err
	}
	tmp := bin + ".building"
	// Stamp the version as KubeVirt's release build does, so that
	// `virtctl version` reports the release it was built from.
	ldflags := fmt.Sprintf("-s -w -X %s.gitVersion=%s -X %s.gitTreeState=clean", versionPkg, version, versionPkg)
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-mod=readonly", "-ldflags="+ldflags, "-o", tmp, mainPackage)
	cmd.Dir = mod
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=-buildvcs=false")
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("build upstream virtctl %s@%s: %w\n%s", module, version, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", err
	}
	return bin, nil
}

// PinnedVersion is the kubevirt.io/kubevirt version the tools module in
// dir requires.
func PinnedVersion(dir string) (string, error) {
	f, err := os.Open(filepath.Join(dir, "go.mod"))
	if err != nil {
		return "", fmt.Errorf("read virtctl pin: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(strings.TrimPrefix(strings.TrimSpace(sc.Text()), "require "))
		if len(fields) >= 2 && fields[0] == module {
			return fields[1], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read virtctl pin: %w", err)
	}
	return "", fmt.Errorf("%s/go.mod does not require %s", dir, module)
}

// flock takes an exclusive lock on f, polling so that it gives up when ctx
// ends (a build takes minutes; a waiter may be cancelled meanwhile).
func flock(ctx context.Context, f *os.File) error {
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err != unix.EWOULDBLOCK {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
