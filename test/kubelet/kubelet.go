// Package kubelet runs a real worker node on this machine for the kubelet
// test (make test-kubelet): containerd (Debian's) with a locally built
// pause image, kubelet and kube-scheduler built from the control plane's
// pin, a pod network from the reference CNI plugins, and a stand-in for
// kube-proxy's one rule hostNetwork pods need (the kubernetes Service).
//
// Kubelet changes the host in ways a test must undo (../shared/KUBELET.md):
// sysctls, fixed directories, kubepods cgroups, mounts, iptables chains.
// Start records every change on an undo list as it makes it, and Stop runs
// the list backwards, so a failed start leaves nothing behind either.
package kubelet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/capacitypods"
	"github.com/nodevirt/nodevirt/clusterbrain/deploy/imagearchive"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// PauseImage is the sandbox image the node's containerd runs pods in.
const PauseImage = "localhost/nodevirt/pause:test"

// RootDir is kubelet's root directory: the default, because the manifests
// name paths below it (plugin registry, CSI sockets, pods).
const RootDir = "/var/lib/kubelet"

// Fixed paths kubelet, containerd and the node agent use whatever their
// configuration; the ones that did not exist before are removed by Stop.
var fixedPaths = []string{RootDir, "/var/log/containers", "/var/log/pods", "/run/containerd", "/opt/containerd",
	"/opt/cni/bin", "/opt/cni", "/var/lib/nodevirt", "/var/lib/kubelet/device-plugins"}

// Sysctls kubelet or the bridge plugin set; Stop puts back the values found.
var sysctls = []string{"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward"}

// Config says where the node runs.
type Config struct {
	// Dir holds containerd's root and state, configurations and logs.
	Dir string
	// NodeName and NodeIP are the Node's name and InternalIP.
	NodeName, NodeIP string
	ControlPlane     *controlplane.ControlPlane
	// APIServerPort is the control plane's secure port (the kubernetes
	// Service is translated to it).
	APIServerPort int
	Bins          controlplane.NodeBinaries
	// PodSubnet is the pod network's subnet (10.88.77.0/24 when empty).
	PodSubnet string
	Log       *slog.Logger
}

// Node is a running worker node.
type Node struct {
	cfg    Config
	Socket string
	procs  []*exec.Cmd
	undo   []func() error
}

const (
	podBridge = "nvkt0"
	nftTable  = "nodevirt_kubelet_test"
)

func (n *Node) onStop(what string, f func() error) {
	n.undo = append(n.undo, func() error {
		if err := f(); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		return nil
	})
}

// Start brings the node up and returns once the Node is Ready. On error
// everything started is undone.
func Start(ctx context.Context, cfg Config) (_ *Node, err error) {
	if cfg.PodSubnet == "" {
		cfg.PodSubnet = "10.88.77.0/24"
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	n := &Node{cfg: cfg, Socket: filepath.Join(cfg.Dir, "containerd.sock")}
	defer func() {
		if err != nil {
			if uerr := n.Stop(); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}
	}()
	for _, p := range fixedPaths {
		if _, err := os.Lstat(p); errors.Is(err, os.ErrNotExist) {
			n.onStop("remove "+p, func() error { return removeTree(p) })
		}
	}
	for _, s := range sysctls {
		path := "/proc/sys/" + s
		old, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		n.onStop("restore "+s, func() error { return os.WriteFile(path, old, 0o644) })
	}
	n.onStop("kubepods cgroups", removeKubepodsCgroups)
	n.onStop("kubelet's iptables chains", removeKubeChains)
	n.onStop("mounts", func() error { return unmountBelow(RootDir, cfg.Dir, "/run/containerd", "/var/lib/nodevirt") })
	n.onStop("pod network namespaces", removePodNetns)
	// Bidirectional mounts need a shared mount under them. Hosts booted by
	// systemd share / ; these build machines' / is private, so the node
	// agent's state gets a shared mount of its own (kubelet makes one of
	// its root directory itself).
	if err := sharedMount("/var/lib/nodevirt"); err != nil {
		return nil, err
	}
	if err := n.podNetwork(); err != nil {
		return nil, err
	}
	if err := n.serviceRule(); err != nil {
		return nil, err
	}
	if err := n.startContainerd(ctx); err != nil {
		return nil, err
	}
	if err := n.importPause(ctx); err != nil {
		return nil, err
	}
	if err := n.startKubelet(ctx); err != nil {
		return nil, err
	}
	if err := n.run(ctx, "kube-scheduler", cfg.Bins.Scheduler, "--kubeconfig="+cfg.ControlPlane.Kubeconfig,
		"--leader-elect=false", "--secure-port=0", "--v=0"); err != nil {
		return nil, err
	}
	if err := n.waitReady(ctx, 2*time.Minute); err != nil {
		return nil, err
	}
	return n, nil
}

// run starts a process logging to Dir/<name>.log; Stop terminates it.
func (n *Node) run(ctx context.Context, name, bin string, args ...string) error {
	logf, err := os.Create(filepath.Join(n.cfg.Dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// containerd-shim-runc-v2 and runc come from Debian's packages.
	cmd.Env = append(os.Environ(), "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	n.procs = append(n.procs, cmd)
	n.onStop("stop "+name, func() error {
		defer logf.Close()
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
		return nil
	})
	n.cfg.Log.Info("started", "process", name, "pid", cmd.Process.Pid)
	return nil
}

// podNetwork writes the reference bridge plugin's configuration; the bridge
// it makes is removed by Stop.
func (n *Node) podNetwork() error {
	dir := filepath.Join(n.cfg.Dir, "cni", "net.d")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	conf := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "kubelet-test", "plugins": [
  {"type": "bridge", "bridge": %q, "isGateway": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "dataDir": %q}},
  {"type": "loopback"}]}
`, podBridge, n.cfg.PodSubnet, filepath.Join(n.cfg.Dir, "cni", "ipam"))
	n.onStop("remove bridge "+podBridge, func() error {
		out, err := exec.Command("ip", "link", "del", podBridge).CombinedOutput()
		if err != nil && !strings.Contains(string(out), "Cannot find device") {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	})
	return os.WriteFile(filepath.Join(dir, "10-kubelet-test.conflist"), []byte(conf), 0o644)
}

// serviceRule stands in for kube-proxy where hostNetwork pods need it: the
// kubernetes Service (10.0.0.1:443, in-cluster clients' address) is
// translated to the API server on this host.
func (n *Node) serviceRule() error {
	rules := fmt.Sprintf(`table ip %s {
  chain output {
    type nat hook output priority -100; policy accept;
    ip daddr 10.0.0.1 tcp dport 443 dnat to %s:%d
  }
}
`, nftTable, n.cfg.NodeIP, n.cfg.APIServerPort)
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft: %w: %s", err, out)
	}
	n.onStop("remove nft table "+nftTable, func() error {
		out, err := exec.Command("nft", "delete", "table", "ip", nftTable).CombinedOutput()
		if err != nil && !strings.Contains(string(out), "No such file") {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	})
	return nil
}

func (n *Node) startContainerd(ctx context.Context) error {
	d := n.cfg.Dir
	conf := fmt.Sprintf(`version = 2
root = %q
state = %q
# /opt/containerd is the opt plugin's: nothing here needs it.
disabled_plugins = ["io.containerd.internal.v1.opt"]
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # The build machines' sessions lack CAP_SYS_RESOURCE: runc may not lower
  # oom_score_adj below its own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
`, filepath.Join(d, "containerd", "root"), filepath.Join(d, "containerd", "state"), n.Socket, PauseImage,
		filepath.Join(d, "cni", "net.d"))
	path := filepath.Join(d, "containerd.toml")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		return err
	}
	// Shims outlive containerd: Stop kills the ones serving this socket.
	n.onStop("containerd shims", func() error { return killShims(n.Socket) })
	if err := n.run(ctx, "containerd", "containerd", "--config", path); err != nil {
		return err
	}
	return waitFor(ctx, 30*time.Second, "containerd socket", func() error {
		c, err := net.Dial("unix", n.Socket)
		if err == nil {
			c.Close()
		}
		return err
	})
}

// Import loads image archives into the node's containerd (the namespace
// kubelet's CRI uses).
func (n *Node) Import(ctx context.Context, archives ...string) error {
	for _, a := range archives {
		out, err := exec.CommandContext(ctx, "ctr", "--address", n.Socket, "-n", "k8s.io", "images", "import", a).CombinedOutput()
		if err != nil {
			return fmt.Errorf("import %s: %w: %s", a, err, out)
		}
		n.cfg.Log.Info("imported", "archive", filepath.Base(a), "out", strings.TrimSpace(string(out)))
	}
	return nil
}

// importPause builds test/cmd/nodevirt-pause statically and imports it as
// PauseImage.
func (n *Node) importPause(ctx context.Context) error {
	root, err := controlplane.RepoRoot()
	if err != nil {
		return err
	}
	bin := filepath.Join(n.cfg.Dir, "pause")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./test/cmd/nodevirt-pause")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build pause: %w: %s", err, out)
	}
	archive := filepath.Join(n.cfg.Dir, "pause.tar")
	f, err := os.Create(archive)
	if err != nil {
		return err
	}
	// Also the cluster's pause image the brain's capacity pods run.
	_, err = imagearchive.Write(f, imagearchive.Image{Names: []string{PauseImage, capacitypods.DefaultImage}, Entrypoint: []string{"/pause"},
		Files: []imagearchive.File{{Path: "/pause", Source: bin, Mode: 0o755}}})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return n.Import(ctx, archive)
}

func (n *Node) startKubelet(ctx context.Context) error {
	d := n.cfg.Dir
	kc := filepath.Join(d, "kubelet.kubeconfig")
	// The node's own identity: the Node authorizer and NodeRestriction
	// hold it to this node.
	if err := n.cfg.ControlPlane.WriteKubeconfig(kc, "system:node:"+n.cfg.NodeName, "system:nodes"); err != nil {
		return err
	}
	conf := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
failCgroupV1: false
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://%s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization: {mode: Webhook}
readOnlyPort: 0
serializeImagePulls: false
# A build machine's disks are full of caches: no evictions for disk pressure.
evictionHard: {memory.available: "50Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
`, n.Socket, n.cfg.ControlPlane.CAFile())
	path := filepath.Join(d, "kubelet.yaml")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		return err
	}
	return n.run(ctx, "kubelet", n.cfg.Bins.Kubelet, "--config="+path, "--kubeconfig="+kc,
		"--hostname-override="+n.cfg.NodeName, "--node-ip="+n.cfg.NodeIP, "--root-dir="+RootDir,
		"--cert-dir="+filepath.Join(d, "kubelet-pki"), "--containerd="+n.Socket, "--v=1")
}

func (n *Node) waitReady(ctx context.Context, timeout time.Duration) error {
	kube, err := kubernetesClient(n.cfg.ControlPlane)
	if err != nil {
		return err
	}
	return waitFor(ctx, timeout, "node "+n.cfg.NodeName+" Ready", func() error {
		node, err := kube.CoreV1().Nodes().Get(ctx, n.cfg.NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return nil
			}
		}
		return errors.New("not Ready")
	})
}

// Stop undoes Start, last step first, and reports every failure.
func (n *Node) Stop() error {
	var errs []error
	for i := len(n.undo) - 1; i >= 0; i-- {
		if err := n.undo[i](); err != nil {
			errs = append(errs, err)
		}
	}
	n.undo = nil
	return errors.Join(errs...)
}

func waitFor(ctx context.Context, timeout time.Duration, what string, f func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s after %s: %w", what, timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// killShims kills the containerd-shim processes serving socket (they are
// started detached and outlive containerd).
func killShims(socket string) error {
	procs, err := filepath.Glob("/proc/[0-9]*/cmdline")
	if err != nil {
		return err
	}
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) == 0 || !strings.Contains(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		for i, a := range args {
			if a == "-address" && i+1 < len(args) && args[i+1] == socket {
				var pid int
				fmt.Sscan(strings.Split(p, "/")[2], &pid)
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	return nil
}

// removeKubepodsCgroups kills what is left in kubelet's kubepods cgroups
// and removes them, in every hierarchy.
func removeKubepodsCgroups() error {
	roots, err := filepath.Glob("/sys/fs/cgroup/*/kubepods")
	if err != nil {
		return err
	}
	if _, err := os.Stat("/sys/fs/cgroup/kubepods"); err == nil {
		roots = append(roots, "/sys/fs/cgroup/kubepods")
	}
	var errs []error
	for _, root := range roots {
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for _, d := range dirs {
			if b, err := os.ReadFile(filepath.Join(d, "cgroup.procs")); err == nil {
				for _, f := range strings.Fields(string(b)) {
					var pid int
					if _, err := fmt.Sscan(f, &pid); err == nil && pid > 1 {
						_ = syscall.Kill(pid, syscall.SIGKILL)
					}
				}
			}
		}
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			var err error
			for try := 0; try < 50; try++ {
				if err = os.Remove(d); err == nil || errors.Is(err, os.ErrNotExist) {
					err = nil
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// removeKubeChains removes the KUBE-* chains kubelet made (its canary
// chains even with makeIPTablesUtilChains off) from every table.
func removeKubeChains() error {
	var errs []error
	for _, tool := range []string{"iptables", "ip6tables"} {
		if _, err := exec.LookPath(tool); err != nil {
			continue
		}
		for _, table := range []string{"filter", "nat", "mangle"} {
			out, err := exec.Command(tool, "-w", "-t", table, "-S").Output()
			if err != nil {
				continue
			}
			var chains []string
			sc := bufio.NewScanner(strings.NewReader(string(out)))
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				if len(f) == 2 && f[0] == "-N" && strings.HasPrefix(f[1], "KUBE-") {
					chains = append(chains, f[1])
				}
			}
			for _, c := range chains {
				_ = exec.Command(tool, "-w", "-t", table, "-F", c).Run()
			}
			// Jumps into them from the built-in chains.
			sc = bufio.NewScanner(strings.NewReader(string(out)))
			for sc.Scan() {
				line := sc.Text()
				if strings.HasPrefix(line, "-A ") && strings.Contains(line, "-j KUBE-") {
					args := append([]string{"-w", "-t", table, "-D"}, strings.Fields(line)[1:]...)
					_ = exec.Command(tool, args...).Run()
				}
			}
			for _, c := range chains {
				if out, err := exec.Command(tool, "-w", "-t", table, "-X", c).CombinedOutput(); err != nil {
					errs = append(errs, fmt.Errorf("%s -t %s -X %s: %w: %s", tool, table, c, err, out))
				}
			}
		}
	}
	return errors.Join(errs...)
}

// unmountBelow detaches every mount at or below the given directories,
// deepest first (kubelet bind-mounts its root dir onto itself; pods'
// volumes, containerd's snapshots and the agent's pools are mounts too).
func unmountBelow(dirs ...string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var targets []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := strings.ReplaceAll(f[4], `\040`, " ")
		for _, d := range dirs {
			if mp == d || strings.HasPrefix(mp, strings.TrimSuffix(d, "/")+"/") {
				targets = append(targets, mp)
				break
			}
		}
	}
	sort.Slice(targets, func(i, j int) bool { return len(targets[i]) > len(targets[j]) })
	var errs []error
	for _, t := range targets {
		if err := unix.Unmount(t, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", t, err))
		}
	}
	return errors.Join(errs...)
}

// removeTree removes p after detaching the mounts below it.
func removeTree(p string) error {
	if err := unmountBelow(p); err != nil {
		return err
	}
	return os.RemoveAll(p)
}

func kubernetesClient(cp *controlplane.ControlPlane) (*kubernetes.Clientset, error) {
	return kubernetes.NewForConfig(cp.RestConfig)
}

// removePodNetns removes the network namespaces containerd made for pods
// (bind mounts under /run/netns named cni-…).
func removePodNetns() error {
	files, err := filepath.Glob("/run/netns/cni-*")
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range files {
		if err := unix.Unmount(f, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", f, err))
		}
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// sharedMount bind-mounts dir onto itself (creating it) and makes the mount
// rshared; Stop's unmounting removes it.
func sharedMount(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s: %w", dir, err)
	}
	if err := unix.Mount("", dir, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", dir, err)
	}
	return nil
}
