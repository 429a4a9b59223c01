// Package lab brings up and tears down the single-machine nodevirt lab: the
// control plane, libvirtd (unless one already runs), the brain and the node
// agent, all detached with logs and pid files under one directory, so that
// `make lab` is idempotent and `make lab-down` removes exactly what it made.
package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// Config locates the lab.
type Config struct {
	// Dir is the lab's state directory (the repo's .lab).
	Dir string
	// BinDir holds the built nodevirt binaries.
	BinDir string
	// Emulation is passed to the node agent: on, off or auto.
	Emulation string
	// NodeName is the lab node's name (one-node lab).
	NodeName string
	// NodeCount is how many nodes the lab runs: 1 (default) runs the node
	// on the host as before; 2 or more run each node in namespaces of its
	// own (see nodes.go), named node1, node2, …
	NodeCount int
	// Kubelet runs the one node as a real kubelet with containerd and
	// installs nodevirt from `make images` onto it (see kubelet.go).
	Kubelet bool
	Out     io.Writer
	Log     *slog.Logger
}

func (c *Config) defaults() error {
	if c.Dir == "" {
		return errors.New("lab dir is required")
	}
	abs, err := filepath.Abs(c.Dir)
	if err != nil {
		return err
	}
	c.Dir = abs
	if c.BinDir != "" {
		if c.BinDir, err = filepath.Abs(c.BinDir); err != nil {
			return err
		}
	}
	if c.Emulation == "" {
		c.Emulation = "on"
	}
	if c.NodeCount == 0 {
		c.NodeCount = max(recordedNodeCount(c.Dir), 1)
	}
	if c.NodeCount < 1 || c.NodeCount > 200 {
		return fmt.Errorf("lab nodes %d: want 1 to 200", c.NodeCount)
	}
	if c.NodeName == "" {
		c.NodeName, _ = os.Hostname()
	}
	if c.Out == nil {
		c.Out = os.Stdout
	}
	if c.Log == nil {
		c.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return nil
}

func (c Config) path(parts ...string) string {
	return filepath.Join(append([]string{c.Dir}, parts...)...)
}

// Kubeconfig is where the lab writes the admin kubeconfig.
func (c Config) Kubeconfig() string { return c.path("kubeconfig") }

// Up brings the lab up, starting only what is not already running.
func Up(ctx context.Context, cfg Config) error {
	if err := cfg.defaults(); err != nil {
		return err
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return err
	}
	if had := recordedNodeCount(cfg.Dir); had != 0 && had != cfg.NodeCount {
		return fmt.Errorf("the lab in %s has %d node(s), not %d: make lab-down first", cfg.Dir, had, cfg.NodeCount)
	} else if had != 0 && recordedKubelet(cfg.Dir) != cfg.Kubelet {
		return fmt.Errorf("the lab in %s runs with kubelet %v, not %v: make lab-down first", cfg.Dir, recordedKubelet(cfg.Dir), cfg.Kubelet)
	}
	if cfg.Kubelet {
		if cfg.NodeCount != 1 {
			return errors.New("a kubelet lab has one node")
		}
		if err := os.WriteFile(cfg.path(kubeletModeFile), nil, 0o644); err != nil {
			return err
		}
	}
	if err := os.WriteFile(cfg.path(nodeCountFile), []byte(strconv.Itoa(cfg.NodeCount)), 0o644); err != nil {
		return err
	}
	step(cfg.Out, "control plane (etcd, kube-apiserver, kube-controller-manager)")
	cpCfg := controlplane.Config{Dir: cfg.path("controlplane"), ControllerManager: true, Detach: true, Log: cfg.Log}
	if cfg.NodeCount > 1 {
		// Nodes reach the API server from their namespaces at the
		// underlay gateway.
		cpCfg.BindAddress = "0.0.0.0"
	}
	if cfg.Kubelet {
		cpCfg = kubeletControlPlane(cfg)
	}
	cp, err := controlplane.Start(ctx, cpCfg)
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	if err := copyFile(cp.Kubeconfig, cfg.Kubeconfig()); err != nil {
		return err
	}
	if err := libvirttest.KVMDeviceAccess(); err != nil {
		return err
	}
	if cfg.NodeCount == 1 {
		step(cfg.Out, "libvirtd and virtlogd")
		if err := startLibvirt(cfg); err != nil {
			return err
		}
	} else if err := upNodes(cfg); err != nil {
		return err
	}
	if cfg.Kubelet {
		if err := upKubelet(ctx, cfg); err != nil {
			return err
		}
		fmt.Fprintf(cfg.Out, "\nnodevirt lab is up on a kubelet node (installed from bin/images/nodevirt.yaml). Next:\n"+
			"  export KUBECONFIG=%s\n"+
			"  kubectl get nodes -o wide; kubectl get pods -n kubevirt-hyperconverged; kubectl get hco -A\n"+
			"  make lab-down    # uninstall, undo what kubelet changed on the host, remove everything the lab made\n"+
			"Logs: %s/*.log, the node's in %s\n", cfg.Kubeconfig(), cfg.Dir, cfg.path("kubelet"))
		return nil
	}
	kube, err := kubernetes.NewForConfig(cp.RestConfig)
	if err != nil {
		return err
	}
	// The daemons run under their own least-privilege identities; the
	// administrator (here the lab) installs their roles once.
	if err := rbac.EnsureDaemons(ctx, kube); err != nil {
		return fmt.Errorf("daemon roles: %w", err)
	}
	step(cfg.Out, "clusterbrain (and a standby)")
	brainKC := cfg.path("clusterbrain.kubeconfig")
	if err := cp.WriteKubeconfig(brainKC, identity.BrainUser, identity.BrainGroup); err != nil {
		return err
	}
	if err := startDaemon(cfg, "clusterbrain", "--kubeconfig="+brainKC, "--health-addr=127.0.0.1:8480",
		"--virtctl-dir="+filepath.Join(cfg.BinDir, "dist")); err != nil {
		return err
	}
	// A standby brain on ports of its own: killing the leading brain hands
	// over (controllers after the lease expires, webhooks and aggregated
	// APIs as soon as their registered server stops answering).
	if err := startDaemonAs(cfg, standbyBrain, "clusterbrain", "--kubeconfig="+brainKC, "--health-addr=127.0.0.1:8490",
		"--webhook-addr=127.0.0.1:8453", "--subresources-addr=:8454", "--upload-api-addr=:8455", "--uploadproxy-addr=:8456", "--template-api-addr=:8458",
		"--node-reads-addr=:8459",
		"--metrics-addr=:8494", "--cli-download-addr=:8492", "--virtctl-dir="+filepath.Join(cfg.BinDir, "dist")); err != nil {
		return err
	}
	if cfg.NodeCount > 1 {
		if err := startNodeAgents(cfg, cp); err != nil {
			return err
		}
	} else if err := startHostAgent(cfg, cp); err != nil {
		return err
	}
	step(cfg.Out, "HyperConverged "+hcov1beta1.DefaultNamespace+"/"+hcov1beta1.Name)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		return err
	}
	if err := EnsureHCO(ctx, kube, virt, cfg.Emulation != "off"); err != nil {
		return err
	}
	if err := waitReady(ctx, cfg, kube, virt); err != nil {
		return err
	}
	fmt.Fprintf(cfg.Out, "\nnodevirt lab is up (%d node(s)). Next:\n"+
		"  export KUBECONFIG=%s\n"+
		"  kubectl get nodes -o wide; kubectl get hco -A\n"+
		"  kubectl api-resources | grep kubevirt\n"+
		"  make demo        # a VM from an imported disk on a bridge\n"+
		"  make lab-down    # remove everything the lab made\n"+
		"Logs: %s/*.log%s\n", cfg.NodeCount, cfg.Kubeconfig(), cfg.Dir, nodesHint(cfg))
	return nil
}

// startHostAgent starts the one-node lab's node agent on the host.
func startHostAgent(cfg Config, cp *controlplane.ControlPlane) error {
	step(cfg.Out, "nodeagent")
	agentKC := cfg.path("nodeagent.kubeconfig")
	if err := cp.WriteKubeconfig(agentKC, identity.NodeUser(cfg.NodeName), identity.NodesGroup); err != nil {
		return err
	}
	agentDir := cfg.path("nodeagent")
	return startDaemon(cfg, "nodeagent", "--kubeconfig="+agentKC, "--node-name="+cfg.NodeName,
		"--state-dir="+agentDir, "--emulation="+cfg.Emulation, "--health-addr=127.0.0.1:8481",
		"--csi-socket="+filepath.Join(agentDir, "csi", "csi.sock"),
		"--pools=default="+cfg.path("pools", "default"))
}

func step(w io.Writer, what string) { fmt.Fprintf(w, "==> %s\n", what) }

// TestServerNetworks is what the lab lets imports reach although nodes
// forbid it by default: loopback, where the demo's image server and the
// tests' servers and registries listen on one node, and the underlay
// gateway, where nodes in namespaces of their own reach them.
var TestServerNetworks = "127.0.0.0/8,::1," + UnderlayGateway

// EnsureHCO creates the namespace and the HyperConverged (asking for
// emulation when told), retrying while a brain that just started
// establishes its CRDs.
func EnsureHCO(ctx context.Context, kube kubernetes.Interface, virt *client.Set, emulation bool) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: hcov1beta1.DefaultNamespace}}
	if _, err := kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	hco := &hcov1beta1.HyperConverged{ObjectMeta: metav1.ObjectMeta{Name: hcov1beta1.Name, Namespace: hcov1beta1.DefaultNamespace,
		Annotations: map[string]string{importstate.AnnImportAllowedNetworks: TestServerNetworks}}}
	if emulation {
		hco.Annotations["nodevirt.io/use-emulation"] = "true"
	}
	// The CRD may still be getting established by a brain that just started.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		_, err := virt.HyperConvergeds.Create(ctx, hco)
		if err == nil || apierrors.IsAlreadyExists(err) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("create HyperConverged: %w", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// waitReady waits for the node to be Ready and the HyperConverged to be
// Available, printing what it waits for.
func waitReady(ctx context.Context, cfg Config, kube kubernetes.Interface, virt *client.Set) error {
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	last := ""
	for {
		status := readiness(ctx, cfg, kube, virt)
		if status == "" {
			fmt.Fprintln(cfg.Out, "==> ready: node Ready, HyperConverged Available")
			return nil
		}
		if status != last {
			fmt.Fprintf(cfg.Out, "    waiting: %s\n", status)
			last = status
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("lab not ready: %s (logs in %s)", status, cfg.Dir)
		case <-time.After(time.Second):
		}
	}
}

func readiness(ctx context.Context, cfg Config, kube kubernetes.Interface, virt *client.Set) string {
	pids := map[string]string{"clusterbrain": cfg.path("clusterbrain"), standbyBrain: cfg.path(standbyBrain)}
	names := []string{cfg.NodeName}
	if nodes := cfg.Nodes(); nodes != nil {
		names = nil
		for _, n := range nodes {
			pids["nodeagent of "+n.Name] = n.path("nodeagent")
			names = append(names, n.Name)
		}
	} else {
		pids["nodeagent"] = cfg.path("nodeagent")
	}
	for _, d := range slices.Sorted(maps.Keys(pids)) {
		if _, ok := controlplane.AlivePid(pids[d] + ".pid"); !ok {
			return d + " is not running (see " + pids[d] + ".log)"
		}
	}
	for _, name := range names {
		if status := ClusterReady(ctx, kube, virt, name); status != "" {
			return status
		}
	}
	return ""
}

// ClusterReady says what is missing before node is Ready and the
// HyperConverged Available, "" when nothing is.
func ClusterReady(ctx context.Context, kube kubernetes.Interface, virt *client.Set, node string) string {
	n, err := kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "node " + node + ": " + err.Error()
	}
	ready := false
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			ready = true
		}
	}
	if !ready {
		return "node " + node + " not Ready"
	}
	hco, err := virt.HyperConvergeds.Get(ctx, hcov1beta1.DefaultNamespace, hcov1beta1.Name)
	if err != nil {
		return "HyperConverged: " + err.Error()
	}
	for _, c := range hco.Status.Conditions {
		if c.Type == "Available" {
			if c.Status == metav1.ConditionTrue {
				return ""
			}
			return "HyperConverged not Available: " + c.Message
		}
	}
	return "HyperConverged has no Available condition yet"
}

// standbyBrain names the lab's second brain (pid and log files).
const standbyBrain = "clusterbrain-standby"

// startDaemon starts a nodevirt binary detached unless its pid file names a
// live process.
func startDaemon(cfg Config, name string, args ...string) error {
	return startDaemonAs(cfg, name, name, args...)
}

// startDaemonAs starts the binary bin under name (its pid and log files).
func startDaemonAs(cfg Config, name, bin string, args ...string) error {
	return startProcess(cfg, cfg.path(name), append([]string{filepath.Join(cfg.BinDir, bin)}, args...))
}

// startProcess starts argv detached, with pid and log files at base.pid
// and base.log, unless the pid file names a live process.
func startProcess(cfg Config, base string, argv []string) error {
	pidFile := base + ".pid"
	if pid, ok := controlplane.AlivePid(pidFile); ok {
		fmt.Fprintf(cfg.Out, "    already running (pid %d)\n", pid)
		return nil
	}
	logf, err := os.OpenFile(base+".log", os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "NODEVIRT_ROOT="+filepath.Dir(cfg.Dir))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", filepath.Base(base), err)
	}
	go cmd.Wait()
	return os.WriteFile(pidFile, []byte(strconv.Itoa(cmd.Process.Pid)), 0o644)
}

// startLibvirt starts virtlogd and libvirtd as plain daemons when none runs,
// recording that the lab owns them.
func startLibvirt(cfg Config) error {
	for _, d := range []struct{ name, sock string }{
		{"virtlogd", "/run/libvirt/virtlogd-sock"},
		{"libvirtd", "/run/libvirt/libvirt-sock"},
	} {
		pidFile := cfg.path(d.name + ".pid")
		if pid, ok := controlplane.AlivePid(pidFile); ok {
			fmt.Fprintf(cfg.Out, "    %s already running (pid %d)\n", d.name, pid)
			continue
		}
		if daemonRunning(d.name) {
			fmt.Fprintf(cfg.Out, "    %s already running (not the lab's)\n", d.name)
			continue
		}
		os.Remove(d.sock)
		cmd := exec.Command(d.name, "--daemon", "--pid-file="+pidFile)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("start %s: %w: %s", d.name, err, out)
		}
		if err := waitFor(d.sock, 20*time.Second); err != nil {
			return fmt.Errorf("%s: %w", d.name, err)
		}
	}
	return nil
}

func daemonRunning(name string) bool {
	out, err := exec.Command("pgrep", "-x", name).Output()
	return err == nil && strings.TrimSpace(string(out)) != ""
}

func waitFor(path string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("%s did not appear within %s", path, timeout)
}

func copyFile(src, dst string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, data, 0o600)
}

// Down stops what Up started and removes what the lab created.
func Down(ctx context.Context, cfg Config) error {
	if err := cfg.defaults(); err != nil {
		return err
	}
	if _, err := os.Stat(cfg.Dir); errors.Is(err, os.ErrNotExist) {
		fmt.Fprintln(cfg.Out, "no lab to remove")
		return nil
	}
	errs := []error{downKubelet(cfg)}
	step(cfg.Out, "nodevirt daemons")
	for _, d := range []string{"nodeagent", "clusterbrain", standbyBrain} {
		if pid, ok := controlplane.AlivePid(cfg.path(d + ".pid")); ok {
			errs = append(errs, controlplane.TerminatePid(pid, 15*time.Second))
		}
	}
	errs = append(errs, downNodes(cfg))
	step(cfg.Out, "guests, bridges, mounts")
	errs = append(errs, removeGuests(cfg), removeNetwork(ctx, cfg), RemoveMounts(cfg.Dir), removeBridges(cfg))
	step(cfg.Out, "libvirtd, virtlogd (if the lab started them)")
	for _, d := range []string{"libvirtd", "virtlogd"} {
		if pid, ok := controlplane.AlivePid(cfg.path(d + ".pid")); ok {
			errs = append(errs, controlplane.TerminatePid(pid, 15*time.Second))
		}
	}
	step(cfg.Out, "control plane")
	errs = append(errs, controlplane.StopDetached(cfg.path("controlplane")))
	if err := errors.Join(errs...); err != nil {
		return err
	}
	step(cfg.Out, "state "+cfg.Dir)
	return os.RemoveAll(cfg.Dir)
}

// record is what the lab remembers creating outside its directory.
type record struct {
	Bridges []string `json:"bridges,omitempty"`
}

// Remember adds bridges to the lab's record so Down removes them.
func Remember(dir string, bridges ...string) error {
	var r record
	file := filepath.Join(dir, "created.json")
	if data, err := os.ReadFile(file); err == nil {
		_ = json.Unmarshal(data, &r)
	}
	r.Bridges = append(r.Bridges, bridges...)
	data, _ := json.Marshal(r)
	return os.WriteFile(file, data, 0o644)
}
