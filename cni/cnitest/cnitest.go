// Package cnitest drives CNI plugin binaries the way a runtime does (libcni,
// cnitool-style) inside throwaway network namespaces, so tests and
// benchmarks never touch the host's own interfaces.
package cnitest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/vishvananda/netns"
)

// NS is a named network namespace (/run/netns/<Name>) this package created.
type NS struct {
	Name string
	Path string
}

// NewNS creates a network namespace named prefix-<random>, leaving the
// calling thread where it was.
func NewNS(prefix string) (*NS, error) {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return nil, err
	}
	name := prefix + "-" + hex.EncodeToString(b)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("current netns: %w", err)
	}
	defer orig.Close()
	h, err := netns.NewNamed(name)
	if err != nil {
		_ = netns.Set(orig)
		return nil, fmt.Errorf("create netns %s: %w", name, err)
	}
	h.Close()
	if err := netns.Set(orig); err != nil {
		// Keep the thread locked: the runtime must not reuse it.
		runtime.LockOSThread()
		return nil, fmt.Errorf("return from netns %s: %w", name, err)
	}
	return &NS{Name: name, Path: filepath.Join("/run/netns", name)}, nil
}

// Close deletes the namespace; deleting one already gone is success.
func (n *NS) Close() error {
	if _, err := os.Stat(n.Path); os.IsNotExist(err) {
		return nil
	}
	if err := netns.DeleteNamed(n.Name); err != nil {
		return fmt.Errorf("delete netns %s: %w", n.Name, err)
	}
	return nil
}

// Do runs fn on a thread inside the namespace. Processes fn starts inherit
// the namespace.
func (n *NS) Do(fn func() error) error {
	target, err := netns.GetFromPath(n.Path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", n.Name, err)
	}
	defer target.Close()
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer orig.Close()
	if err := netns.Set(target); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", n.Name, err)
	}
	fnErr := fn()
	if err := netns.Set(orig); err != nil {
		return fmt.Errorf("leave netns %s: %w", n.Name, err)
	}
	runtime.UnlockOSThread()
	return fnErr
}

// Run runs a command inside the namespace and returns its combined output.
func (n *NS) Run(ctx context.Context, name string, args ...string) (string, error) {
	var out []byte
	err := n.Do(func() error {
		var err error
		out, err = exec.CommandContext(ctx, name, args...).CombinedOutput()
		return err
	})
	if err != nil {
		return string(out), fmt.Errorf("%s %s in %s: %w: %s", name, strings.Join(args, " "), n.Name, err, out)
	}
	return string(out), nil
}

// Runtime invokes plugins through libcni from inside a "host" namespace.
type Runtime struct {
	Host *NS
	CNI  *libcni.CNIConfig
}

// NewRuntime makes a runtime searching pluginDirs, caching results in
// cacheDir, running plugins inside host.
func NewRuntime(host *NS, pluginDirs []string, cacheDir string) *Runtime {
	return &Runtime{Host: host, CNI: libcni.NewCNIConfigWithCacheDir(pluginDirs, cacheDir, nil)}
}

// List parses a config (single plugin or conflist) into a list.
func List(conf []byte) (*libcni.NetworkConfigList, error) {
	if strings.Contains(string(conf), `"plugins"`) {
		return libcni.ConfListFromBytes(conf)
	}
	pc, err := libcni.ConfFromBytes(conf)
	if err != nil {
		return nil, err
	}
	return libcni.ConfListFromConf(pc)
}

// Attachment names one container interface.
func Attachment(containerID string, netns *NS, ifName string) *libcni.RuntimeConf {
	rt := &libcni.RuntimeConf{ContainerID: containerID, IfName: ifName}
	if netns != nil {
		rt.NetNS = netns.Path
	}
	return rt
}

// Add runs ADD.
func (r *Runtime) Add(ctx context.Context, conf []byte, rt *libcni.RuntimeConf) (types.Result, error) {
	l, err := List(conf)
	if err != nil {
		return nil, err
	}
	var res types.Result
	err = r.Host.Do(func() error {
		var err error
		res, err = r.CNI.AddNetworkList(ctx, l, rt)
		return err
	})
	return res, err
}

// Del runs DEL.
func (r *Runtime) Del(ctx context.Context, conf []byte, rt *libcni.RuntimeConf) error {
	l, err := List(conf)
	if err != nil {
		return err
	}
	return r.Host.Do(func() error { return r.CNI.DelNetworkList(ctx, l, rt) })
}

// Check runs CHECK with the cached ADD result.
func (r *Runtime) Check(ctx context.Context, conf []byte, rt *libcni.RuntimeConf) error {
	l, err := List(conf)
	if err != nil {
		return err
	}
	return r.Host.Do(func() error { return r.CNI.CheckNetworkList(ctx, l, rt) })
}

// Status runs STATUS.
func (r *Runtime) Status(ctx context.Context, conf []byte) error {
	l, err := List(conf)
	if err != nil {
		return err
	}
	return r.Host.Do(func() error { return r.CNI.GetStatusNetworkList(ctx, l) })
}

// GC runs GC with the given still-valid attachments.
func (r *Runtime) GC(ctx context.Context, conf []byte, valid []types.GCAttachment) error {
	l, err := List(conf)
	if err != nil {
		return err
	}
	return r.Host.Do(func() error {
		return r.CNI.GCNetworkList(ctx, l, &libcni.GCArgs{ValidAttachments: valid})
	})
}

// BuildPlugin builds the cnv-bridge binary (static) into dir and links Debian's
// reference plugins (host-local, static, bridge) beside it, returning dir.
func BuildPlugin(ctx context.Context, dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	// Static, as CNI plugins ship: no dynamic loader on each of the plugin's
	// (and its unregistration helper's) process starts.
	cmd := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(dir, "cnv-bridge"),
		"github.com/nodevirt/nodevirt/cni/cmd/cnv-bridge")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build cnv-bridge: %w: %s", err, out)
	}
	if err := os.Symlink("cnv-bridge", filepath.Join(dir, "nodevirt-bridge")); err != nil && !os.IsExist(err) {
		return "", err
	}
	for _, p := range []string{"host-local", "static"} {
		src := filepath.Join(ReferenceDir, p)
		if _, err := os.Stat(src); err != nil {
			continue
		}
		if err := os.Symlink(src, filepath.Join(dir, p)); err != nil && !os.IsExist(err) {
			return "", err
		}
	}
	return dir, nil
}

// ReferenceDir holds Debian's containernetworking-plugins binaries.
const ReferenceDir = "/usr/lib/cni"

// BuildCNITool builds upstream cnitool (the containernetworking/cni module
// this repository already depends on) into dir and returns its path.
func BuildCNITool(ctx context.Context, dir string) (string, error) {
	out := filepath.Join(dir, "cnitool")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "github.com/containernetworking/cni/cnitool")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build cnitool: %w: %s", err, b)
	}
	return out, nil
}

// CNITool runs cnitool VERB NETWORK NETNS inside host, with the networks of
// confDir (NETCONFPATH) and the plugins of pluginDir (CNI_PATH), and returns
// its output.
func CNITool(ctx context.Context, host *NS, tool, confDir, pluginDir, verb, network string, netns *NS) (string, error) {
	var out []byte
	err := host.Do(func() error {
		cmd := exec.CommandContext(ctx, tool, verb, network, netns.Path)
		cmd.Env = append(os.Environ(), "NETCONFPATH="+confDir, "CNI_PATH="+pluginDir)
		var err error
		out, err = cmd.CombinedOutput()
		return err
	})
	if err != nil {
		return string(out), fmt.Errorf("cnitool %s %s %s: %w: %s", verb, network, netns.Path, err, out)
	}
	return string(out), nil
}
