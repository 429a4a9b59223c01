package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/test/bench/measure"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// benchNamespace holds the bench's VMs.
const benchNamespace = "bench"

// cluster is one point's environment: a control plane, the real brain
// binary as a child process and the simulated nodes, under one directory.
type cluster struct {
	dir   string
	cp    *controlplane.ControlPlane
	kube  kubernetes.Interface
	virt  *client.Set
	brain *exec.Cmd
	// brainExit receives the brain's exit once.
	brainExit chan error
	sim       *nodeSim
	simStop   context.CancelFunc
	simDone   chan struct{}
	apiPid    int
	etcdPid   int
}

// startCluster brings up the control plane and the brain (built at
// brainBin), then registers nNodes simulated nodes and waits until the
// brain has them all Ready and untainted.
func startCluster(ctx context.Context, brainBin string, nNodes int, heartbeat time.Duration) (c *cluster, err error) {
	dir, err := os.MkdirTemp("", "nodevirt-bench-scale-")
	if err != nil {
		return nil, err
	}
	c = &cluster{dir: dir}
	defer func() {
		if err != nil {
			c.stop()
		}
	}()
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if c.cp, err = controlplane.Start(ctx, controlplane.Config{Dir: filepath.Join(dir, "controlplane"), Log: quiet}); err != nil {
		return c, fmt.Errorf("control plane: %w", err)
	}
	c.apiPid, c.etcdPid = measure.ControlPlanePid("kube-apiserver", dir), measure.ControlPlanePid("etcd", dir)
	rc := rest.CopyConfig(c.cp.RestConfig)
	rc.QPS, rc.Burst = 2000, 4000
	if c.kube, err = kubernetes.NewForConfig(rc); err != nil {
		return c, err
	}
	if c.virt, err = client.NewSet(rc); err != nil {
		return c, err
	}
	// The brain runs under its own identity and roles, as a deployment
	// runs it.
	if err := rbac.EnsureDaemons(ctx, c.kube); err != nil {
		return c, fmt.Errorf("daemon roles: %w", err)
	}
	kc := filepath.Join(dir, "clusterbrain.kubeconfig")
	if err := c.cp.WriteKubeconfig(kc, identity.BrainUser, identity.BrainGroup); err != nil {
		return c, err
	}
	if err := c.startBrain(brainBin, kc); err != nil {
		return c, err
	}
	if err := c.prepare(ctx); err != nil {
		return c, err
	}
	c.sim = newNodeSim(c.kube, nNodes, heartbeat)
	if err := c.sim.register(ctx, 16); err != nil {
		return c, fmt.Errorf("register nodes: %w", err)
	}
	simCtx, stop := context.WithCancel(ctx)
	c.simStop, c.simDone = stop, make(chan struct{})
	go func() { defer close(c.simDone); c.sim.run(simCtx) }()
	return c, c.waitNodes(ctx, 3*time.Minute)
}

func (c *cluster) startBrain(bin, kubeconfig string) error {
	logf, err := os.Create(filepath.Join(c.dir, "clusterbrain.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	c.brain = exec.Command(bin, "--kubeconfig="+kubeconfig, "--health-addr="+freeAddr(),
		"--webhook-addr=127.0.0.1:0", "--subresources-addr=:0", "--upload-api-addr=:0", "--uploadproxy-addr=:0",
		"--template-api-addr=:0", "--node-reads-addr=:0", "--metrics-addr=127.0.0.1:0", "--cli-download-addr=127.0.0.1:0")
	c.brain.Stdout, c.brain.Stderr = logf, logf
	c.brain.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := c.brain.Start(); err != nil {
		return fmt.Errorf("start clusterbrain: %w", err)
	}
	c.brainExit = make(chan error, 1)
	go func(cmd *exec.Cmd) { c.brainExit <- cmd.Wait() }(c.brain)
	return nil
}

// brainAlive returns an error with the brain's last log lines when it has
// exited.
func (c *cluster) brainAlive() error {
	select {
	case err := <-c.brainExit:
		c.brainExit <- err
		return fmt.Errorf("clusterbrain exited (%v):\n%s", err, c.brainLog(20))
	default:
		return nil
	}
}

func (c *cluster) brainLog(lines int) string {
	data, _ := os.ReadFile(filepath.Join(c.dir, "clusterbrain.log"))
	l := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(l[max(0, len(l)-lines):], "\n")
}

// prepare creates what the bench's VMs use once the brain has installed
// the API — their namespace, the bridge network they attach to, the
// HyperConverged a deployment has — and waits until creations go through
// the brain's MAC webhook.
func (c *cluster) prepare(ctx context.Context) error {
	if _, err := c.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: benchNamespace}},
		metav1.CreateOptions{}); err != nil {
		return err
	}
	nad := &nadv1.NetworkAttachmentDefinition{ObjectMeta: metav1.ObjectMeta{Namespace: benchNamespace, Name: "br1",
		Annotations: map[string]string{scheduler.NADResourceName: scheduler.BridgePrefix + "br1"}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: `{"cniVersion":"0.3.1","type":"cnv-bridge","bridge":"br1"}`}}
	hco := &hcov1beta1.HyperConverged{ObjectMeta: metav1.ObjectMeta{Name: hcov1beta1.Name, Namespace: hcov1beta1.DefaultNamespace}}
	// The brain installs the CRDs as it starts; wait for them.
	return c.poll(ctx, 3*time.Minute, func() (string, error) {
		if _, err := c.virt.NADs.Create(ctx, nad); err != nil && !apierrors.IsAlreadyExists(err) {
			return "network attachment definition: " + err.Error(), nil
		}
		if _, err := c.virt.HyperConvergeds.Create(ctx, hco); err != nil && !apierrors.IsAlreadyExists(err) {
			return "HyperConverged: " + err.Error(), nil
		}
		probe := newVM("probe", false)
		got, err := c.virt.VMs.Create(ctx, probe)
		if err != nil {
			return "probe VM: " + err.Error(), nil
		}
		_ = c.virt.VMs.Delete(ctx, benchNamespace, probe.Name, metav1.DeleteOptions{})
		if got.Spec.Template.Spec.Domain.Devices.Interfaces[0].MacAddress == "" {
			return "probe VM got no MAC address (webhook not active yet)", nil
		}
		return "", nil
	})
}

// waitNodes waits until every simulated node is Ready and carries no
// lifecycle taint (the brain lifts the not-ready taint the API server puts
// on new Nodes once it sees their Leases).
func (c *cluster) waitNodes(ctx context.Context, timeout time.Duration) error {
	return c.poll(ctx, timeout, func() (string, error) {
		if n := c.nodesNotReady(ctx); n != 0 {
			return fmt.Sprintf("%d of %d simulated nodes not Ready or tainted", n, len(c.sim.names)), nil
		}
		return "", nil
	})
}

// nodesNotReady counts the simulated nodes that are not Ready or carry a
// taint (-1 when they cannot be listed).
func (c *cluster) nodesNotReady(ctx context.Context) int {
	nodes, err := c.kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return -1
	}
	bad := len(c.sim.names) - len(nodes.Items)
	for _, n := range nodes.Items {
		ready := false
		for _, cond := range n.Status.Conditions {
			ready = ready || cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue
		}
		if !ready || len(n.Spec.Taints) > 0 {
			bad++
		}
	}
	return bad
}

// poll calls check every second until it returns "" or an error, the brain
// exits or timeout passes.
func (c *cluster) poll(ctx context.Context, timeout time.Duration, check func() (string, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		missing, err := check()
		if err != nil || missing == "" {
			return err
		}
		if err := c.brainAlive(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("after %s: %s\nclusterbrain log:\n%s", timeout, missing, c.brainLog(20))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// stop ends the simulator, the brain and the control plane and removes the
// directory (kept, with its logs, when NODEVIRT_BENCH_KEEP is set).
func (c *cluster) stop() {
	if c.simStop != nil {
		c.simStop()
		<-c.simDone
	}
	if c.brain != nil && c.brain.Process != nil {
		_ = c.brain.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.brainExit:
		case <-time.After(30 * time.Second):
			_ = c.brain.Process.Kill()
			<-c.brainExit
		}
	}
	if c.cp != nil {
		c.cp.Stop()
	}
	if os.Getenv("NODEVIRT_BENCH_KEEP") != "" {
		fmt.Fprintln(os.Stderr, "kept", c.dir)
		return
	}
	_ = os.RemoveAll(c.dir)
}

func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err) // loopback always has free ports
	}
	defer l.Close()
	return l.Addr().String()
}

// buildBrain builds the clusterbrain binary into dir.
func buildBrain(ctx context.Context, dir string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir+"/", "./clusterbrain/cmd/clusterbrain")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build clusterbrain: %w\n%s", err, out)
	}
	return filepath.Join(dir, "clusterbrain"), nil
}
