package lab

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// nodeCountFile records how many nodes the lab was brought up with, so
// down, demo and exec find them without being told.
const nodeCountFile = "nodecount"

// recordedNodeCount is the node count of the lab in dir, 0 when unknown.
func recordedNodeCount(dir string) int {
	data, err := os.ReadFile(filepath.Join(dir, nodeCountFile))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return n
}

// RecordedNodes is how many nodes the lab in dir was brought up with, 0
// when none was.
func RecordedNodes(dir string) int { return recordedNodeCount(dir) }

// upNodes brings up the multi-node lab's nodes up to their libvirtd: the
// host-side fabric, then each node's namespaces, cgroups, private
// directories and virtlogd/libvirtd.
func upNodes(cfg Config) error {
	step(cfg.Out, fmt.Sprintf("%d nodes: namespaces, underlay %s (%s), switch %s, libvirtd+virtlogd each",
		cfg.NodeCount, UnderlayBridge, UnderlayGateway, SwitchBridge))
	if err := LabFabric.Up(cfg.Dir); err != nil {
		return fmt.Errorf("lab fabric: %w", err)
	}
	nodes := cfg.Nodes()
	for _, n := range nodes {
		if err := StartNode(n, nodes); err != nil {
			return err
		}
		fmt.Fprintf(cfg.Out, "    %s: netns %s, ip %s, pod subnet %s, libvirt host uuid %s\n",
			n.Name, n.Netns(), n.IP, n.PodCIDR, n.HostUUID())
	}
	return nil
}

// StartNode brings node n (one of nodes) up to its libvirtd: its netns and
// links, cgroups, private directories and configuration, the holder of its
// namespaces, virtlogd and libvirtd. What already runs is kept.
func StartNode(n Node, nodes []Node) error {
	hs, err := hostCgroups()
	if err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	if err := ensureNodeNet(n); err != nil {
		return fmt.Errorf("node %s network: %w", n.Name, err)
	}
	if err := ensureNodeCgroups(hs, n); err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	if err := writeNodeFiles(nodes, n, hs); err != nil {
		return fmt.Errorf("node %s files: %w", n.Name, err)
	}
	if err := startHolder(n); err != nil {
		return err
	}
	return startNodeLibvirt(n)
}

// RemoveNode kills every process of node n and removes its netns, links
// and cgroups; what is gone already is success.
func RemoveNode(n Node) error {
	hs, err := hostCgroups()
	if err != nil {
		return err
	}
	var errs []error
	if _, err := os.Stat("/run/netns/" + n.Netns()); err == nil {
		errs = append(errs, PowerOff(n), run("ip", "netns", "del", n.Netns()))
	}
	// Deleting the netns deletes the veths' other ends, asynchronously.
	under, sw := n.links()
	for _, l := range []string{under, sw} {
		if err := run("ip", "link", "del", l); err != nil && linkExists(l) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, removeNodeCgroups(hs, n))
	return errors.Join(errs...)
}

// Down removes the host side of f (bridges, NAT table) and restores IPv4
// forwarding as Up found it.
func (f Fabric) Down(stateDir string) error {
	var errs []error
	for _, br := range []string{f.UnderlayBridge(), f.SwitchBridge} {
		if linkExists(br) {
			errs = append(errs, run("ip", "link", "del", br))
		}
	}
	if err := run("nft", "delete", "table", "ip", f.natTable()); err != nil && !strings.Contains(err.Error(), "No such file") {
		errs = append(errs, err)
	}
	if old, err := os.ReadFile(filepath.Join(stateDir, "ip_forward.saved")); err == nil {
		errs = append(errs, os.WriteFile("/proc/sys/net/ipv4/ip_forward", old, 0o644))
	} else if !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// startNodeAgents starts every node's agent inside its node; the agents
// reach the API server at the underlay gateway.
func startNodeAgents(cfg Config, cp *controlplane.ControlPlane) error {
	step(cfg.Out, "nodeagents")
	server, err := UnderlayServer(LabFabric, cp.URL)
	if err != nil {
		return err
	}
	var argvs [][]string
	for _, n := range cfg.Nodes() {
		kc := n.path("nodeagent.kubeconfig")
		if err := cp.WriteKubeconfig(kc, identity.NodeUser(n.Name), identity.NodesGroup); err != nil {
			return err
		}
		if err := PointKubeconfig(kc, server); err != nil {
			return err
		}
		dir := n.AgentDir()
		argv := EnterCommand(n, filepath.Join(cfg.BinDir, "nodeagent"), "--kubeconfig="+kc, "--node-name="+n.Name,
			"--node-ip="+n.IP, "--pod-cidr="+n.PodCIDR, "--state-dir="+dir, "--emulation="+cfg.Emulation,
			"--health-addr=127.0.0.1:8481", "--csi-socket="+filepath.Join(dir, "csi", "csi.sock"),
			"--pools=default="+n.path("pools", "default"),
			// Live migrations as in production: libvirt's TLS and QEMU's
			// native TLS for the stream, with the node's certificate; the
			// agent keeps its blocks in the node's own /etc/libvirt.
			"--migration-transport=tls", "--libvirt-conf-dir=/etc/libvirt")
		fmt.Fprintf(cfg.Out, "    %s\n", n.Name)
		if err := startProcess(cfg, n.path("nodeagent"), argv); err != nil {
			return err
		}
		argvs = append(argvs, argv)
	}
	// Once an agent has its certificate, its node's libvirtd serves it
	// (restarted; the agent then starts again on the new libvirtd).
	for i, n := range cfg.Nodes() {
		restarted, err := ServeLibvirtTLS(n, 3*time.Minute)
		if err != nil {
			return err
		}
		if !restarted {
			continue
		}
		fmt.Fprintf(cfg.Out, "    %s: libvirtd serves TLS with the node certificate\n", n.Name)
		if pid, ok := controlplane.AlivePid(n.path("nodeagent.pid")); ok {
			if err := controlplane.TerminatePid(pid, 30*time.Second); err != nil {
				return err
			}
		}
		if err := startProcess(cfg, n.path("nodeagent"), argvs[i]); err != nil {
			return err
		}
	}
	return nil
}

// UnderlayServer is the API server's URL (on loopback) as nodes on f
// reach it.
func UnderlayServer(f Fabric, url string) (string, error) {
	i := strings.LastIndex(url, ":")
	if i < 0 {
		return "", fmt.Errorf("api server url %q has no port", url)
	}
	return "https://" + f.Gateway() + url[i:], nil
}

// PointKubeconfig makes a kubeconfig reach the API server at server while
// still verifying its certificate for 127.0.0.1.
func PointKubeconfig(file, server string) error {
	kc, err := clientcmd.LoadFromFile(file)
	if err != nil {
		return err
	}
	for _, c := range kc.Clusters {
		c.Server = server
		c.TLSServerName = "127.0.0.1"
	}
	return clientcmd.WriteToFile(*kc, file)
}

func nodesHint(cfg Config) string {
	nodes := cfg.Nodes()
	if nodes == nil {
		return ""
	}
	var b strings.Builder
	b.WriteString("\nNodes (each its own network, mount, UTS and cgroup namespace):\n")
	for _, n := range nodes {
		fmt.Fprintf(&b, "  %-8s %-12s netns %s, pod subnet %s, logs %s/*.log\n", n.Name, n.IP, n.Netns(), n.PodCIDR, n.Dir)
	}
	fmt.Fprintf(&b, "  %s/nodevirt-lab exec %s -- virsh -c qemu:///system list   # a command inside a node\n",
		cfg.BinDir, nodes[0].Name)
	fmt.Fprintf(&b, "  bridge %s on every node joins switch %s: a cnv-bridge NAD on it connects VMs across nodes",
		LabBridge, SwitchBridge)
	return b.String()
}

// netnsPids lists the processes in the named network namespace.
func netnsPids(ns string) []int {
	out, err := exec.Command("ip", "netns", "pids", ns).Output()
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// PowerOff kills every process of node n at once (its agent, libvirtd,
// virtlogd, QEMU, the holder): a host's power loss. Its network namespace
// and links stay, as a powered-off host's cables do.
func PowerOff(n Node) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		pids := netnsPids(n.Netns())
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("node %s: processes %v survive SIGKILL", n.Name, pids)
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// downNodes stops and removes every node of a multi-node lab and the host
// fabric: the agents get SIGTERM first, then everything left in a node's
// netns is killed, the netns, links and cgroups removed.
func downNodes(cfg Config) error {
	nodes := cfg.Nodes()
	if nodes == nil {
		return nil
	}
	step(cfg.Out, fmt.Sprintf("%d nodes", len(nodes)))
	var errs []error
	for _, n := range nodes {
		if pid, ok := controlplane.AlivePid(n.path("nodeagent.pid")); ok {
			errs = append(errs, controlplane.TerminatePid(pid, 15*time.Second))
		}
		fmt.Fprintf(cfg.Out, "    %s: processes, netns %s, links, cgroups\n", n.Name, n.Netns())
		errs = append(errs, RemoveNode(n))
	}
	errs = append(errs, LabFabric.Down(cfg.Dir))
	return errors.Join(errs...)
}

// NodeCommand is the command line that runs argv inside the lab's node
// named node (`nodevirt-lab exec`).
func NodeCommand(cfg Config, node string, argv ...string) ([]string, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	n, err := cfg.Node(node)
	if err != nil {
		return nil, err
	}
	if _, ok := controlplane.AlivePid(n.path("holder.pid")); !ok {
		return nil, fmt.Errorf("node %s is not running (make lab)", n.Name)
	}
	return EnterCommand(n, argv...), nil
}

// PowerOffNode kills every process of the lab's node named node
// (PowerOff).
func PowerOffNode(cfg Config, node string) error {
	if err := cfg.defaults(); err != nil {
		return err
	}
	n, err := cfg.Node(node)
	if err != nil {
		return err
	}
	return PowerOff(n)
}
