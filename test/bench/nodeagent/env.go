package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/lab"
)

// env is one run: a control plane, the brain and the agent as child
// processes, all under one temporary directory.
type env struct {
	dir      string
	bin      string
	node     string
	ns       string
	bridge   string
	cidr     string
	cold     bool
	cp       *controlplane.ControlPlane
	kube     kubernetes.Interface
	virt     *client.Set
	brain    *exec.Cmd
	agent    *exec.Cmd
	agentAt  string
	metrics  string
	agentErr chan error
	// guests is how many guests runGuests started (guest-0, guest-1, ...).
	guests int
}

func newEnv(ctx context.Context, cfg config) (*env, error) {
	dir, err := os.MkdirTemp("", "nodevirt-bench-nodeagent-")
	if err != nil {
		return nil, err
	}
	// QEMU's user reaches the guest's disk below it.
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, err
	}
	// Names of this run: its node, its guest's namespace, its pod network
	// (a bridge and subnet of its own, so a lab's is left alone).
	id := strconv.Itoa(os.Getpid() % 100000)
	e := &env{dir: dir, bin: cfg.bin, cold: cfg.cold, node: "bench-" + id, ns: "bench-nodeagent-" + id,
		bridge: "nvbenchp" + id, cidr: fmt.Sprintf("10.%d.%d.0/24", 250+os.Getpid()%5, os.Getpid()%256)}
	if e.bin == "" {
		e.bin = filepath.Join(dir, "bin")
		if err := build(ctx, e.bin); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	return e, nil
}

// build compiles the daemons as the Makefile's build rule does.
func build(ctx context.Context, bin string) error {
	for _, args := range [][]string{
		// The Makefile's NODEAGENT_BUILDFLAGS.
		{"build", "-trimpath", "-tags", "grpcnotrace,libvirt_without_lxc", "-ldflags=-s -w", "-o", bin + "/", "./nodeagent/cmd/nodeagent"},
		{"build", "-o", bin + "/", "./clusterbrain/cmd/clusterbrain"},
	} {
		cmd := exec.CommandContext(ctx, "go", args...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

func (e *env) path(parts ...string) string {
	return filepath.Join(append([]string{e.dir}, parts...)...)
}

// start brings up the control plane, libvirt, the brain and the agent, and
// waits until the node serves.
func (e *env) start(ctx context.Context) error {
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var err error
	e.cp, err = controlplane.Start(ctx, controlplane.Config{Dir: e.path("controlplane"), ControllerManager: true, Log: quiet})
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	if e.kube, err = kubernetes.NewForConfig(e.cp.RestConfig); err != nil {
		return err
	}
	if e.virt, err = client.NewSet(e.cp.RestConfig); err != nil {
		return err
	}
	if err := libvirttest.Start(); err != nil {
		return fmt.Errorf("libvirtd: %w", err)
	}
	if err := rbac.EnsureDaemons(ctx, e.kube); err != nil {
		return fmt.Errorf("daemon roles: %w", err)
	}
	brainKC, agentKC := e.path("clusterbrain.kubeconfig"), e.path("nodeagent.kubeconfig")
	if err := e.cp.WriteKubeconfig(brainKC, identity.BrainUser, identity.BrainGroup); err != nil {
		return err
	}
	if err := e.cp.WriteKubeconfig(agentKC, identity.NodeUser(e.node), identity.NodesGroup); err != nil {
		return err
	}
	if e.brain, err = e.daemon("clusterbrain", "--kubeconfig="+brainKC, "--health-addr="+freeAddr("127.0.0.1"),
		"--webhook-addr=127.0.0.1:0", "--subresources-addr=:0", "--upload-api-addr=:0", "--uploadproxy-addr=:0", "--template-api-addr=:0",
		"--node-reads-addr=:0", "--metrics-addr=127.0.0.1:0", "--cli-download-addr=127.0.0.1:0"); err != nil {
		return err
	}
	// The agent starts as on a node that just booted: its executable is
	// read from disk, not found in the page cache as the compiler (or a
	// copy) left it, whose folio sizes change how much of it each page
	// fault maps and so the resident size being measured.
	if e.cold {
		if err := dropCached(filepath.Join(e.bin, "nodeagent")); err != nil {
			return err
		}
	}
	e.agentAt, e.metrics = freeAddr("127.0.0.1"), freeAddr("127.0.0.1")
	agentDir := e.path("nodeagent")
	if e.agent, err = e.daemon("nodeagent", "--kubeconfig="+agentKC, "--node-name="+e.node,
		"--state-dir="+agentDir, "--emulation=on", "--health-addr="+e.agentAt,
		"--csi-socket="+filepath.Join(agentDir, "csi", "csi.sock"), "--pools=default="+e.path("pools", "default"),
		"--console-addr="+freeAddr("127.0.0.1"), "--upload-addr="+freeAddr(""), "--metrics-addr="+e.metrics,
		"--pod-bridge="+e.bridge, "--pod-cidr="+e.cidr, "--host-disk-root="+e.path("disks")); err != nil {
		return err
	}
	e.agentErr = make(chan error, 1)
	go func(cmd *exec.Cmd) { e.agentErr <- cmd.Wait() }(e.agent)
	if err := lab.EnsureHCO(ctx, e.kube, e.virt, true); err != nil {
		return err
	}
	if err := e.enableHostDisk(ctx); err != nil {
		return err
	}
	return e.waitReady(ctx, 3*time.Minute)
}

// daemon starts a built binary with its output in <dir>/<name>.log.
func (e *env) daemon(name string, args ...string) (*exec.Cmd, error) {
	logf, err := os.Create(e.path(name + ".log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(e.bin, name), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return cmd, nil
}

func freeAddr(host string) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err) // loopback always has free ports
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return net.JoinHostPort(host, port)
}

// waitReady waits until the Node is Ready, the HyperConverged Available and
// the agent's /readyz (every role started) answers.
func (e *env) waitReady(ctx context.Context, timeout time.Duration) error {
	return e.poll(ctx, timeout, func() (string, error) {
		if missing := lab.ClusterReady(ctx, e.kube, e.virt, e.node); missing != "" {
			return missing, nil
		}
		resp, err := (&http.Client{Timeout: 2 * time.Second}).Get("http://" + e.agentAt + "/readyz")
		if err != nil {
			return "agent /readyz: " + err.Error(), nil
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Sprintf("agent /readyz: %d %s", resp.StatusCode, body), nil
		}
		return "", nil
	})
}

// poll calls check until it returns "" or an error, the agent exits or
// timeout passes; the last answer of check says what was missing.
func (e *env) poll(ctx context.Context, timeout time.Duration, check func() (string, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		missing, err := check()
		if err != nil || missing == "" {
			return err
		}
		select {
		case err := <-e.agentErr:
			e.agentErr <- err
			return fmt.Errorf("nodeagent exited (%v): %s", err, tail(e.path("nodeagent.log"), 20))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after %s: %s\nnodeagent log:\n%s", timeout, missing, tail(e.path("nodeagent.log"), 20))
		}
	}
}

// runGuests starts guests until n run, each a VMI of the test suite's
// boot disk under TCG on a copy of its own, and waits until each is
// Running and the agent's /metrics counts all n running.
func (e *env) runGuests(ctx context.Context, n int) error {
	src, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		return fmt.Errorf("guest disk: %w", err)
	}
	if err := os.MkdirAll(e.path("disks"), 0o755); err != nil {
		return err
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.ns}}
	if _, err := e.kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	for ; e.guests < n; e.guests++ {
		if err := e.startGuest(ctx, src, guestName(e.guests)); err != nil {
			return err
		}
	}
	// The agent's roles see them too: its metrics count them as running.
	running := fmt.Sprintf(" %d", n)
	return e.poll(ctx, 2*time.Minute, func() (string, error) {
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + e.metrics + "/metrics")
		if err != nil {
			return "agent /metrics: " + err.Error(), nil
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, l := range strings.Split(string(body), "\n") {
			if strings.HasPrefix(l, "kubevirt_vmi_phase_count{") && strings.Contains(l, `phase="running"`) && strings.HasSuffix(l, running) {
				return "", nil
			}
		}
		return fmt.Sprintf("agent /metrics: kubevirt_vmi_phase_count does not count %d running", n), nil
	})
}

func guestName(i int) string { return fmt.Sprintf("guest-%d", i) }

// startGuest creates one guest on a sparse copy of src and waits until its
// VMI is Running.
func (e *env) startGuest(ctx context.Context, src, name string) error {
	disk := e.path("disks", name+".raw")
	if out, err := exec.CommandContext(ctx, "cp", "--sparse=always", src, disk).CombinedOutput(); err != nil {
		return fmt.Errorf("copy guest disk: %w: %s", err, out)
	}
	grace := int64(5)
	no := false
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{
			TerminationGracePeriodSeconds: &grace,
			Domain: kubevirtv1.DomainSpec{
				Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceMemory: resource.MustParse("128Mi")}},
				Devices: kubevirtv1.Devices{AutoattachPodInterface: &no,
					Disks: []kubevirtv1.Disk{{Name: "rootdisk",
						DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}}}},
			},
			Volumes: []kubevirtv1.Volume{{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{
				HostDisk: &kubevirtv1.HostDisk{Path: disk, Type: kubevirtv1.HostDiskExists}}}},
		}}
	if _, err := e.virt.VMIs.Create(ctx, vmi); err != nil {
		return fmt.Errorf("create vmi %s: %w", name, err)
	}
	return e.poll(ctx, 2*time.Minute, func() (string, error) {
		got, err := e.virt.VMIs.Get(ctx, e.ns, name)
		if err != nil {
			return "vmi: " + err.Error(), nil
		}
		if got.Status.Phase == kubevirtv1.Failed {
			return "", fmt.Errorf("vmi %s failed: %+v", name, got.Status.Conditions)
		}
		if got.Status.Phase != kubevirtv1.Running {
			return fmt.Sprintf("vmi %s phase %q", name, got.Status.Phase), nil
		}
		return "", nil
	})
}

// memory is what /proc/<pid>/status says of a process, in bytes.
// libs is the part of rss in mappings of shared libraries (libvirt's
// client library and its dependencies, libc). pss is the proportional set
// size from /proc/<pid>/smaps_rollup: each page shared with other
// processes (libvirtd maps the same libraries) counted by its share.
type memory struct{ rss, anon, file, shmem, libs, pss int64 }

// sample lets the agent run for settle, then reads its memory.
func (e *env) sample(ctx context.Context, settle time.Duration) (memory, error) {
	select {
	case <-time.After(settle):
	case <-ctx.Done():
		return memory{}, ctx.Err()
	}
	select {
	case err := <-e.agentErr:
		e.agentErr <- err
		return memory{}, fmt.Errorf("nodeagent exited (%v): %s", err, tail(e.path("nodeagent.log"), 20))
	default:
	}
	m, err := readStatus(e.agent.Process.Pid)
	if err != nil {
		return memory{}, err
	}
	if m.libs, err = libraryRSS(e.agent.Process.Pid); err != nil {
		return memory{}, err
	}
	m.pss, err = proportional(e.agent.Process.Pid)
	return m, err
}

// proportional reads a process's Pss from /proc/<pid>/smaps_rollup.
func proportional(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "Pss:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("pss in /proc/%d/smaps_rollup: %w", pid, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, fmt.Errorf("no Pss in /proc/%d/smaps_rollup", pid)
}

// libraryRSS sums the resident size of a process's shared-library mappings
// from /proc/<pid>/smaps.
func libraryRSS(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var total int64
	lib := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		switch {
		case len(fields) >= 5 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":"):
			// A mapping's header: address range, perms, offset, dev, inode[, path].
			lib = len(fields) == 6 && strings.Contains(filepath.Base(fields[5]), ".so")
		case lib && len(fields) == 3 && fields[0] == "Rss:":
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("rss in /proc/%d/smaps: %w", pid, err)
			}
			total += kb * 1024
		}
	}
	return total, sc.Err()
}

func readStatus(pid int) (memory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return memory{}, err
	}
	defer f.Close()
	var m memory
	fields := map[string]*int64{"VmRSS:": &m.rss, "RssAnon:": &m.anon, "RssFile:": &m.file, "RssShmem:": &m.shmem}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && fields[f[0]] != nil {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return memory{}, fmt.Errorf("%s in /proc/%d/status: %w", f[0], pid, err)
			}
			*fields[f[0]] = kb * 1024
		}
	}
	if m.rss == 0 {
		return memory{}, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
	}
	return m, sc.Err()
}

// teardown deletes the guest (the agent destroys its domain), stops the
// daemons, removes the pod network, leftover domains and the control plane.
func (e *env) teardown(keep bool) error {
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for i := 0; e.virt != nil && i < e.guests; i++ {
		name := guestName(i)
		if err := e.virt.VMIs.Delete(ctx, e.ns, name, metav1.DeleteOptions{}); err == nil {
			errs = append(errs, e.poll(ctx, 60*time.Second, func() (string, error) {
				if _, err := e.virt.VMIs.Get(ctx, e.ns, name); !apierrors.IsNotFound(err) {
					return "vmi " + name + " still there", nil
				}
				return "", nil
			}))
		}
	}
	for _, cmd := range []*exec.Cmd{e.agent, e.brain} {
		if cmd != nil && cmd.Process != nil {
			_ = cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	if e.agent != nil {
		select {
		case <-e.agentErr:
		case <-time.After(30 * time.Second):
			_ = e.agent.Process.Kill()
		}
	}
	if e.brain != nil {
		done := make(chan struct{})
		go func() { e.brain.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = e.brain.Process.Kill()
		}
	}
	// A domain the agent left (it was killed) goes with its namespace.
	for i := 0; i < e.guests; i++ {
		dom := e.ns + "_" + guestName(i)
		if exec.Command("virsh", "-c", "qemu:///system", "domstate", dom).Run() == nil {
			_ = exec.Command("virsh", "-c", "qemu:///system", "destroy", dom).Run()
			_ = exec.Command("virsh", "-c", "qemu:///system", "undefine", dom).Run()
		}
	}
	if e.agent != nil {
		out, err := exec.Command(filepath.Join(e.bin, "nodeagent"), "--teardown-podnet", "--state-dir="+e.path("nodeagent"),
			"--node-name="+e.node, "--pod-bridge="+e.bridge, "--pod-cidr="+e.cidr).CombinedOutput()
		if err != nil {
			errs = append(errs, fmt.Errorf("pod network teardown: %w: %s", err, out))
		}
	}
	errs = append(errs, lab.RemoveMounts(e.dir))
	if e.cp != nil {
		e.cp.Stop()
	}
	if err := errors.Join(errs...); err != nil || keep {
		fmt.Fprintf(os.Stderr, "bench nodeagent: keeping %s\n", e.dir)
		return err
	}
	return os.RemoveAll(e.dir)
}

// dropCached writes path's dirty pages and drops it from the page cache
// (only this file).
func dropCached(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		return fmt.Errorf("sync %s: %w", path, err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		return fmt.Errorf("drop %s from the page cache: %w", path, err)
	}
	return nil
}

// tail is the last n lines of a log file.
func tail(path string, n int) string {
	data, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// enableHostDisk turns KubeVirt's HostDisk gate on the way an administrator
// does (HCO's KubeVirt JSON-patch annotation) and waits until the KubeVirt
// CR has it: the guest's disk is a hostDisk under the agent's
// --host-disk-root.
func (e *env) enableHostDisk(ctx context.Context) error {
	gate := `[{"op":"add","path":"/spec/configuration/developerConfiguration/featureGates/-","value":"HostDisk"}]`
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		hcov1beta1.JSONPatchKubeVirtAnnotation: gate}}})
	if err != nil {
		return err
	}
	if _, err := e.virt.HyperConvergeds.Patch(ctx, hcov1beta1.DefaultNamespace, hcov1beta1.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("enable HostDisk: %w", err)
	}
	return e.poll(ctx, time.Minute, func() (string, error) {
		kvs, err := e.virt.KubeVirts.List(ctx, hcov1beta1.DefaultNamespace, metav1.ListOptions{})
		if err != nil {
			return "kubevirt: " + err.Error(), nil
		}
		for _, kv := range kvs {
			if featuregate.KubeVirtEnabled(kv, featuregate.HostDisk) {
				return "", nil
			}
		}
		return "HostDisk gate not on the KubeVirt CR yet", nil
	})
}
