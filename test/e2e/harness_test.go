package e2e

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/cni/bridge"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/nodeagent/agent"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/lab"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// suite is the product under test, shared by every test of the binary.
var suite *env

// env is one running nodevirt: control plane, brain, agent and what the
// suite made on the host.
type env struct {
	run      string // run id, part of every name the suite makes
	root     string // temporary directory holding everything
	repo     string
	bin      string
	nodeName string

	cp   *controlplane.ControlPlane
	rest *rest.Config
	kube kubernetes.Interface
	virt *client.Set

	brain *daemon
	agent *daemon
	// agent2 is the second node's agent (multinode_test.go); node2Err is
	// why the second node could not start (the cross-node tests fail
	// with it, the others run).
	agent2   *daemon
	node2Err error

	// setupErr is why the product could not be started at all: every test
	// fails with it.
	setupErr error
	// notReady is why the lab did not become ready (node Ready,
	// HyperConverged Available); TestLabReady fails with it, the other
	// tests run anyway and fail on their own symptoms.
	notReady string

	mu       sync.Mutex
	bridges  []string
	bridgeNo int
}

// TestMain brings nodevirt up once for the whole suite and tears it down.
func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	flag.Parse()
	// Most of a test's time is spent waiting for guests: let several wait
	// at once unless -parallel was given.
	explicit := false
	flag.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "test.parallel" })
	if !explicit {
		_ = flag.Set("test.parallel", "6")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	suite = &env{run: runID()}
	start := time.Now()
	suite.setupErr = suite.setup(ctx)
	if suite.setupErr != nil {
		fmt.Fprintf(os.Stderr, "e2e: setup failed after %s: %v\n", time.Since(start).Round(time.Second), suite.setupErr)
	} else {
		fmt.Fprintf(os.Stderr, "e2e: nodevirt up in %s (run %s, node %s, dir %s)\n",
			time.Since(start).Round(100*time.Millisecond), suite.run, suite.nodeName, suite.root)
		if suite.notReady != "" {
			fmt.Fprintf(os.Stderr, "e2e: lab NOT ready: %s\n", suite.notReady)
		}
	}
	code := m.Run()
	if code != 0 {
		suite.dumpLogs(os.Stderr, 60)
	}
	if err := suite.teardown(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: teardown: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

func runID() string {
	const letters = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 5)
	for i := range b {
		b[i] = letters[rand.IntN(len(letters))]
	}
	return string(b)
}

// require returns the suite's environment, failing t when the product could
// not be started.
func require(t *testing.T) *env {
	t.Helper()
	if suite == nil || suite.setupErr != nil {
		t.Fatalf("nodevirt is not running: %v", suite.setupErr)
	}
	return suite
}

func (e *env) path(parts ...string) string {
	return filepath.Join(append([]string{e.root}, parts...)...)
}

// setup builds the binaries, starts the control plane, libvirtd when none
// runs, the brain and the agent, creates the HyperConverged and waits for
// readiness.
func (e *env) setup(ctx context.Context) error {
	var err error
	if e.repo, err = controlplane.RepoRoot(); err != nil {
		return err
	}
	if e.root, err = os.MkdirTemp("", "nodevirt-e2e-"+e.run+"-"); err != nil {
		return err
	}
	// QEMU runs as an unprivileged user and must reach the disks and the
	// VM state under here.
	if err := os.Chmod(e.root, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(e.path("suite.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return err
	}
	sweepStale()
	e.nodeName = "e2e-" + e.run
	e.bin = e.path("bin")
	if err := e.build(ctx); err != nil {
		return err
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	// The second node reaches the API server from its own network
	// namespace, at its fabric's gateway.
	e.cp, err = controlplane.Start(ctx, controlplane.Config{Dir: e.path("controlplane"), ControllerManager: true, Log: quiet,
		BindAddress: "0.0.0.0"})
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	e.rest = rest.CopyConfig(e.cp.RestConfig)
	e.rest.QPS, e.rest.Burst = 100, 200
	if e.kube, err = kubernetes.NewForConfig(e.rest); err != nil {
		return err
	}
	if e.virt, err = client.NewSet(e.rest); err != nil {
		return err
	}
	if err := libvirttest.Start(); err != nil {
		return err
	}
	// The fabric comes up before the first agent, whose console server
	// listens on the fabric's gateway (startDaemons).
	e.node2Err = e.upFabric()
	if err := e.startDaemons(); err != nil {
		return err
	}
	if e.node2Err == nil {
		e.node2Err = e.startSecondNode()
	}
	if e.node2Err != nil {
		fmt.Fprintf(os.Stderr, "e2e: second node: %v\n", e.node2Err)
	}
	if err := e.createHCO(ctx); err != nil {
		return err
	}
	e.notReady = e.waitReady(ctx, 90*time.Second)
	return nil
}

// build compiles the daemons and the CNI plugin once for the run.
func (e *env) build(ctx context.Context) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", e.bin+"/",
		"./nodeagent/cmd/nodeagent", "./clusterbrain/cmd/clusterbrain", "./cni/cmd/cnv-bridge")
	cmd.Dir = e.repo
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build nodevirt binaries: %w\n%s", err, out)
	}
	return nil
}

// startDaemons starts the brain and the agent with their own kubeconfigs
// and addresses, so the suite can run beside a lab.
func (e *env) startDaemons() error {
	brainKC, agentKC := e.path("clusterbrain.kubeconfig"), e.path("nodeagent.kubeconfig")
	// The daemons run under their own least-privilege identities, as in
	// the lab; installing their roles is the administrator's part.
	if err := rbac.EnsureDaemons(context.Background(), e.kube); err != nil {
		return fmt.Errorf("daemon roles: %w", err)
	}
	if err := e.cp.WriteKubeconfig(brainKC, identity.BrainUser, identity.BrainGroup); err != nil {
		return err
	}
	if err := e.cp.WriteKubeconfig(agentKC, identity.NodeUser(e.nodeName), identity.NodesGroup); err != nil {
		return err
	}
	brainArgs := []string{"--kubeconfig=" + brainKC, "--health-addr=" + freeAddr(), "--fencing-window=" + fencingWindow.String(),
		// Every listener of the brain takes a port the kernel picks (the
		// brain registers what it bound), so the suite never races another
		// process for a port nor collides with a lab on the same host.
		// Aggregated APIs are reached through Endpoints, which may not be
		// loopback: those listen on every address.
		"--webhook-addr=127.0.0.1:0", "--subresources-addr=:0", "--upload-api-addr=:0", "--uploadproxy-addr=:0", "--template-api-addr=:0",
		"--node-reads-addr=:0", "--metrics-addr=127.0.0.1:0", "--cli-download-addr=127.0.0.1:0"}
	e.brain = newDaemon(e, "clusterbrain", brainArgs...)
	agentDir := e.path("nodeagent")
	agentArgs := []string{"--kubeconfig=" + agentKC, "--node-name=" + e.nodeName, "--fencing-window=" + fencingWindow.String(), "--heartbeat=" + heartbeat.String(),
		"--state-dir=" + agentDir, "--emulation=on", "--health-addr=" + freeAddr(),
		"--csi-socket=" + filepath.Join(agentDir, "csi", "csi.sock"),
		"--pools=" + poolName() + "=" + e.path("pools", poolName()), "--host-disk-root=" + e.path("disks")}
	// The console server defaults to virt-handler's port 8186, which a lab
	// on the same host holds: give it a free port. The agent advertises
	// it on its Node, for the brain and as this node's peer address, which
	// the other nodes dial from their namespaces before they fence
	// themselves (nodeagent/agent/fence.go): it listens on the fabric's
	// gateway, the host's address they reach, and on loopback only when
	// the fabric did not come up (then no other node runs).
	consoleHost := "127.0.0.1"
	if e.node2Err == nil {
		consoleHost = e.fabric().Gateway()
	}
	agentArgs = append(agentArgs, optionalAddrFlags(filepath.Join(e.bin, "nodeagent"), consoleHost, "console-addr")...)
	agentArgs = append(agentArgs, optionalAddrFlags(filepath.Join(e.bin, "nodeagent"), "", "upload-addr", "metrics-addr")...)
	// Its own pod network bridge and subnet, so a lab's pod network on the
	// same host is left alone (teardown removes this one).
	agentArgs = append(agentArgs, "--pod-bridge="+e.podBridge(), "--pod-cidr="+e.podCIDR())
	e.agent = newDaemon(e, "nodeagent", agentArgs...)
	if err := e.brain.start(); err != nil {
		return err
	}
	return e.agent.start()
}

// optionalAddrFlags returns --name=<host>:<free port> for each flag the
// binary declares.
func optionalAddrFlags(bin, host string, names ...string) []string {
	out, _ := exec.Command(bin, "-h").CombinedOutput()
	var args []string
	for _, n := range names {
		if strings.Contains(string(out), "-"+n+" ") || strings.Contains(string(out), "-"+n+"\n") {
			_, port, _ := net.SplitHostPort(freeAddr())
			args = append(args, "--"+n+"="+net.JoinHostPort(host, port))
		}
	}
	return args
}

func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err) // loopback always has free ports
	}
	defer l.Close()
	return l.Addr().String()
}

// createHCO creates the HyperConverged with emulation, retrying while the
// brain installs the CRDs.
func (e *env) createHCO(ctx context.Context) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: hcov1beta1.DefaultNamespace}}
	if _, err := e.kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	// Test guests boot from hostDisks (spec_test.go) under the agent's
	// --host-disk-root: the suite turns KubeVirt's HostDisk gate on as an
	// administrator does, with HCO's JSON-patch annotation.
	hco := &hcov1beta1.HyperConverged{ObjectMeta: metav1.ObjectMeta{Name: hcov1beta1.Name, Namespace: hcov1beta1.DefaultNamespace,
		Annotations: map[string]string{"nodevirt.io/use-emulation": "true",
			hcov1beta1.JSONPatchKubeVirtAnnotation: hostDiskGatePatch,
			// The test image servers and registries listen on loopback,
			// which imports may not reach by default.
			importstate.AnnImportAllowedNetworks: lab.TestServerNetworks}},
		// Migrations of TCG guests on a loaded 2-core machine moved at
		// 1.4–6.5 MB/s: KubeVirt's 150 s per GiB gives the suite's small
		// guests under 20 s, which such a run exceeds. The migration
		// tests check that migrations work, not how fast.
		Spec: hcov1beta1.HyperConvergedSpec{LiveMigrationConfig: hcov1beta1.LiveMigrationConfigurations{
			CompletionTimeoutPerGiB: ptr.To(int64(1000))}}}
	return testkit.Wait(300*time.Millisecond, 90*time.Second, "the HyperConverged created (clusterbrain installs its CRD)", func() (bool, error) {
		_, err := e.virt.HyperConvergeds.Create(ctx, hco)
		if err == nil || apierrors.IsAlreadyExists(err) {
			return true, nil
		}
		if !e.brain.alive() {
			return false, testkit.Stop(fmt.Errorf("clusterbrain exited: %s", e.brain.tail(20)))
		}
		return false, err
	})
}

// waitReady waits for the node to be Ready and the HyperConverged to be
// Available, and returns what is missing ("" when ready).
func (e *env) waitReady(ctx context.Context, timeout time.Duration) string {
	var status string
	_ = testkit.Wait(500*time.Millisecond, timeout, "readiness", func() (bool, error) {
		status = e.readiness(ctx)
		return status == "", nil
	})
	return status
}

func (e *env) readiness(ctx context.Context) string {
	for _, d := range []*daemon{e.brain, e.agent} {
		if !d.alive() {
			return d.name + " exited: " + d.tail(10)
		}
	}
	node, err := e.kube.CoreV1().Nodes().Get(ctx, e.nodeName, metav1.GetOptions{})
	if err != nil {
		return "node " + e.nodeName + ": " + err.Error()
	}
	if !nodeReady(node) {
		return "node " + e.nodeName + " not Ready"
	}
	hco, err := e.virt.HyperConvergeds.Get(ctx, hcov1beta1.DefaultNamespace, hcov1beta1.Name)
	if err != nil {
		return "HyperConverged: " + err.Error()
	}
	var all []string
	available := false
	for _, c := range hco.Status.Conditions {
		available = available || (c.Type == "Available" && c.Status == metav1.ConditionTrue)
		all = append(all, fmt.Sprintf("%s=%s (%s: %s)", c.Type, c.Status, c.Reason, c.Message))
	}
	if available {
		return ""
	}
	return "HyperConverged not Available: " + strings.Join(all, "; ")
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// healthy tells whether a daemon's /readyz answers 200.
func healthy(addr string) bool {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + addr + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// teardown removes everything the run made: its objects (so the agent
// stops the guests), then the daemons, leftover domains, mounts, loop
// devices, bridges and taps, the control plane and the directory.
func (e *env) teardown() error {
	if e.root == "" {
		return nil
	}
	var errs []error
	if e.kube != nil && e.agent != nil && e.agent.alive() {
		errs = append(errs, e.deleteRunNamespaces(60*time.Second))
	}
	for _, d := range []*daemon{e.agent, e.brain} {
		if d != nil {
			d.stop()
		}
	}
	errs = append(errs, e.removeSecondNode(), e.removeDomains(), e.removePodNetwork(), e.removeMounts(), e.removeBridges(),
		bridge.RemoveUnusedTables(context.Background()))
	if e.cp != nil {
		e.cp.Stop()
	}
	if len(errs) > 0 && errors.Join(errs...) != nil {
		fmt.Fprintf(os.Stderr, "e2e: keeping %s for inspection\n", e.root)
		return errors.Join(errs...)
	}
	return os.RemoveAll(e.root)
}

// deleteRunNamespaces deletes the run's namespaces that tests left behind
// and waits until their VMIs are gone.
func (e *env) deleteRunNamespaces(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	list, err := e.kube.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	var errs []error
	for _, ns := range list.Items {
		if strings.HasPrefix(ns.Name, "e2e-"+e.run+"-") {
			errs = append(errs, e.emptyNamespace(ctx, ns.Name))
			_ = e.kube.CoreV1().Namespaces().Delete(ctx, ns.Name, metav1.DeleteOptions{})
		}
	}
	return errors.Join(errs...)
}

// sweepStale removes what earlier runs left when their test binary died
// before its teardown (a panic, a kill): their domains, mounts, bridges and
// directories. A run is stale when the process in its suite.pid is gone.
func sweepStale() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "nodevirt-e2e-*"))
	for _, dir := range dirs {
		data, err := os.ReadFile(filepath.Join(dir, "suite.pid"))
		if err != nil {
			continue
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && processAlive(pid) {
			continue
		}
		run, _, ok := strings.Cut(strings.TrimPrefix(filepath.Base(dir), "nodevirt-e2e-"), "-")
		if !ok {
			continue
		}
		fmt.Fprintf(os.Stderr, "e2e: removing what the dead run %s left\n", run)
		stale := &env{run: run, root: dir, nodeName: "e2e-" + run}
		stale.bridges, _ = filepath.Glob("/sys/class/net/nve2e" + run + "*")
		for i, b := range stale.bridges {
			stale.bridges[i] = filepath.Base(b)
		}
		if errors.Join(stale.removeSecondNode(), stale.removeDomains(), stale.removePodNetwork(), stale.removeMounts(), stale.removeBridges()) == nil {
			os.RemoveAll(dir)
		}
	}
}

// poolName is the name of the agent's storage pool: "default", as the lab
// names it, unless NODEVIRT_E2E_POOL says otherwise.
func poolName() string {
	if p := os.Getenv("NODEVIRT_E2E_POOL"); p != "" {
		return p
	}
	return "default"
}

// podBridge and podCIDR name this run's pod network.
func (e *env) podBridge() string { return "nve2ep" + e.run }

func (e *env) podCIDR() string {
	h := fnv.New32a()
	h.Write([]byte(e.run))
	return fmt.Sprintf("10.%d.%d.0/24", 200+h.Sum32()%50, (h.Sum32()>>8)%256)
}

// removePodNetwork removes the pod network the run's agent set up.
func (e *env) removePodNetwork() error {
	return agent.TeardownPodNetwork(context.Background(), agent.Config{StateDir: e.path("nodeagent"),
		NodeName: e.nodeName, PodBridge: e.podBridge(), PodCIDR: e.podCIDR()})
}
