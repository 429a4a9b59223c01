package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/test/lab"
)

// The suite's second node runs the way `make lab NODES=N` runs its nodes
// (test/lab): its own network, mount, UTS and cgroup namespaces, libvirtd
// and virtlogd, node agent and pod subnet. The suite's first node (the
// agent on the host) is plugged into the same fabric: the fabric's switch
// bridge in the host namespace carries the name of the second node's lab
// bridge, so a cnv-bridge NAD on that name joins VMs on both nodes.

// fencingWindow is the suite's (package fencing): short, so that a lost
// node's VMs move within a test's patience.
// The agents renew every 2 s: a loaded machine delays a renewal by
// seconds, and the window must outlast a few of them.
const (
	fencingWindow = 10 * time.Second
	heartbeat     = 2 * time.Second
)

// secondNodeTaint keeps the tests that do not ask for the second node off
// it: they look at their domains in the host's libvirtd.
const secondNodeTaint = "nodevirt.io/e2e-second-node"

// fabric is the run's: names and an underlay subnet of its own, so a lab
// and other runs on the host are left alone.
func (e *env) fabric() lab.Fabric {
	h := fnv.New32a()
	h.Write([]byte(e.run))
	p := "nvm" + e.run
	return lab.Fabric{Prefix: p, Subnet: fmt.Sprintf("10.78.%d", h.Sum32()%250), SwitchBridge: p + "l", LabBridge: p + "l",
		NetnsPrefix: "nve2e-"}
}

// node2 is the run's second node.
func (e *env) node2() lab.Node {
	h := fnv.New32a()
	h.Write([]byte(e.run))
	return lab.NewNode(e.fabric(), e.nodeName+"-2", 2, e.path("node2"), fmt.Sprintf("10.79.%d.0/24", h.Sum32()%250))
}

// secondNode is the second node for a test that needs one; the test fails
// when it did not come up.
func (e *env) secondNode(t *testing.T) lab.Node {
	t.Helper()
	if e.node2Err != nil {
		t.Fatalf("second node: %v", e.node2Err)
	}
	return e.node2()
}

// upFabric brings the run's fabric up on the host, its state kept in the
// second node's directory (removeSecondNode takes it down).
func (e *env) upFabric() error {
	n := e.node2()
	if err := os.MkdirAll(n.Dir, 0o755); err != nil {
		return err
	}
	if err := e.fabric().Up(n.Dir); err != nil {
		return fmt.Errorf("fabric: %w", err)
	}
	return nil
}

// startSecondNode brings the second node up with its agent, on the fabric
// upFabric brought up.
func (e *env) startSecondNode() error {
	f, n := e.fabric(), e.node2()
	if err := lab.StartNode(n, []lab.Node{n}); err != nil {
		return err
	}
	kc := filepath.Join(n.Dir, "nodeagent.kubeconfig")
	if err := e.cp.WriteKubeconfig(kc, identity.NodeUser(n.Name), identity.NodesGroup); err != nil {
		return err
	}
	server, err := lab.UnderlayServer(f, e.cp.URL)
	if err != nil {
		return err
	}
	if err := lab.PointKubeconfig(kc, server); err != nil {
		return err
	}
	// The Node exists before its agent, tainted, and the agent adopts it as
	// its own (standalone): nothing lands there untolerated.
	if _, err := e.kube.CoreV1().Nodes().Create(context.Background(), &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: map[string]string{"nodevirt.io/nodeagent": "standalone",
			corev1.LabelHostname: n.Name}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: secondNodeTaint, Effect: corev1.TaintEffectNoSchedule}}},
	}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("pre-create node %s: %w", n.Name, err)
	}
	return e.startAgent2()
}

// startAgent2 starts (again) the second node's agent.
func (e *env) startAgent2() error {
	n := e.node2()
	kc := filepath.Join(n.Dir, "nodeagent.kubeconfig")
	argv := e.extraAgentCommand(n, kc)
	e.agent2 = newDaemon(e, "nodeagent-2")
	e.agent2.bin, e.agent2.args = argv[0], argv[1:]
	return serveLibvirtTLS(n, e.agent2)
}

// extraAgentCommand is the command line of the node agent of n, a node in
// namespaces of its own beside the suite's first, with kubeconfig kc.
func (e *env) extraAgentCommand(n lab.Node, kc string) []string {
	dir := n.AgentDir()
	return lab.EnterCommand(n, filepath.Join(e.bin, "nodeagent"), "--kubeconfig="+kc, "--node-name="+n.Name,
		"--fencing-window="+fencingWindow.String(), "--heartbeat="+heartbeat.String(),
		"--node-ip="+n.IP, "--pod-cidr="+n.PodCIDR, "--state-dir="+dir, "--emulation=on",
		"--csi-socket="+filepath.Join(dir, "csi", "csi.sock"),
		"--pools="+poolName()+"="+filepath.Join(n.Dir, "pools", poolName()),
		// The guests' hostDisks, as for the first node (harness_test.go).
		"--host-disk-root="+e.path("disks"),
		// Live migrations between the suite's namespaced nodes
		// (migration_test.go) over libvirt's TLS with the nodes' own
		// certificates, which the node's libvirtd serves once the agent
		// wrote them (lab.ServeLibvirtTLS); the agent writes libvirt's and
		// QEMU's TLS settings into the node's own /etc/libvirt.
		"--migration-transport=tls", "--libvirt-conf-dir=/etc/libvirt")
}

// serveLibvirtTLS starts agent, the agent of extra node n, and once it has
// written its certificate makes n's libvirtd serve TLS with it; the agent
// starts again on the restarted libvirtd.
func serveLibvirtTLS(n lab.Node, agent *daemon) error {
	if err := agent.start(); err != nil {
		return err
	}
	// The agent's certificate from the brain's signer.
	const wait = 2 * time.Minute
	restarted, err := lab.ServeLibvirtTLS(n, wait)
	if err != nil || !restarted {
		return err
	}
	agent.stop()
	return agent.start()
}

// removeSecondNode stops the second node and removes it and the fabric.
func (e *env) removeSecondNode() error {
	if e.agent2 != nil {
		e.agent2.stop()
	}
	n := e.node2()
	if _, err := os.Stat(n.Dir); err != nil {
		return nil
	}
	return errors.Join(e.removeThirdNode(), lab.RemoveNode(n), e.fabric().Down(n.Dir))
}

// nodeVirsh runs virsh inside node n.
func nodeVirsh(n lab.Node, args ...string) (string, error) {
	argv := lab.EnterCommand(n, append([]string{"virsh", "-c", libvirtURI}, args...)...)
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("virsh on %s %s: %w: %s", n.Name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// serialOn opens the serial log of the VMI's domain on node n.
func (n *testNS) serialOn(node lab.Node, vmi string) *serialLog {
	n.t.Helper()
	s := &serialLog{n: n, vmi: vmi}
	n.eventually(60*time.Second, fmt.Sprintf("serial log of %s/%s on %s", n.name, vmi, node.Name), func() (bool, string) {
		out, err := nodeVirsh(node, "dumpxml", domainName(n.name, vmi))
		if err != nil {
			return false, err.Error()
		}
		dom := &libvirtxml.Domain{}
		if err := dom.Unmarshal(out); err != nil {
			return false, err.Error()
		}
		if dom.Devices != nil {
			for _, sr := range dom.Devices.Serials {
				if sr.Log != nil && sr.Log.File != "" {
					s.path = sr.Log.File
					return true, ""
				}
			}
		}
		return false, "domain has no serial log"
	})
	n.t.Cleanup(func() {
		if s.f != nil {
			s.f.Close()
		}
	})
	return s
}

func withNodeSelector(node string) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.NodeSelector = map[string]string{corev1.LabelHostname: node}
	}
}

// onSecondNodeToo lets a VMI run on the suite's second node.
func onSecondNodeToo() vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.Tolerations = append(s.Tolerations, corev1.Toleration{Key: secondNodeTaint, Operator: corev1.TolerationOpExists})
	}
}

// TestCrossNode: the scheduler places two VMs on different nodes by
// nodeSelector; the one on the second node (its own namespaces, libvirtd
// and agent, reached by the brain over the underlay) boots and upstream
// virtctl reaches its console through the brain; both talk over a
// cnv-bridge NAD whose bridge the fabric joins across the nodes.
func TestCrossNode(t *testing.T) {
	t.Parallel()
	e := require(t)
	node2 := e.secondNode(t)
	n := e.namespace(t)
	n.eventually(90*time.Second, "node "+node2.Name+" Ready", func() (bool, string) {
		node, err := e.kube.CoreV1().Nodes().Get(context.Background(), node2.Name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, a := range node.Status.Addresses {
			if a.Type == corev1.NodeInternalIP && a.Address != node2.IP {
				t.Errorf("node %s InternalIP %s, want its underlay address %s", node2.Name, a.Address, node2.IP)
			}
		}
		return nodeReady(node), "not Ready"
	})

	br := e.fabric().LabBridge
	conf, _ := json.Marshal(map[string]any{"cniVersion": "0.3.1", "name": "cross", "type": "cnv-bridge", "bridge": br, "macspoofchk": true})
	if _, err := e.virt.NADs.Create(context.Background(), &nadv1.NetworkAttachmentDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "cross", Namespace: n.name, Annotations: map[string]string{
			"k8s.v1.cni.cncf.io/resourceName": "bridge.network.kubevirt.io/" + br}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: string(conf)},
	}); err != nil {
		t.Fatalf("create NetworkAttachmentDefinition: %v", err)
	}
	vms := []struct{ name, node, self, peer string }{
		{"first", e.nodeName, "10.232.0.1", "10.232.0.2"},
		{"second", node2.Name, "10.232.0.2", "10.232.0.1"},
	}
	for _, v := range vms {
		n.createVM(n.newVM(v.name, kubevirtv1.RunStrategyAlways, withBridge("cross"), withNodeSelector(v.node), onSecondNodeToo(),
			withUserData(pingUserData(v.self, v.peer))))
	}
	for _, v := range vms {
		vmi := n.waitVMIOfVM(v.name, 2*time.Minute)
		if vmi.Status.NodeName != v.node {
			t.Fatalf("vmi %s runs on %q, its nodeSelector says %s", v.name, vmi.Status.NodeName, v.node)
		}
	}
	if _, err := domainXML(n.name, "second"); err == nil {
		t.Errorf("the host's libvirtd has the domain of the VM placed on %s", node2.Name)
	}
	for _, v := range vms {
		var s *serialLog
		if v.node == node2.Name {
			s = n.serialOn(node2, v.name)
		} else {
			s = n.serial(v.name)
		}
		s.expect(`NODEVIRT-IP eth0 `+v.self+`/24`, bootTimeout)
		s.expect(`E2E-PING-(OK|FAILED) `+v.peer, 150*time.Second)
		if !s.contains(`E2E-PING-OK ` + v.peer) {
			t.Errorf("%s on %s could not ping %s on the other node over %s", v.name, v.node, v.peer, br)
		}
	}
	t.Run("console on the second node", func(t *testing.T) { n.upstreamVirtctl().checkConsole("second") })
}

// TestNodePowerLoss: every process of the second node is killed at once
// (its agent, libvirtd, QEMU): past the fencing window plus margin the brain
// fails the VMI over (NodeUnreachable, an event on the VM) and the VM runs
// again on the first node, its disk being reachable there; when the node
// comes back it cleans up the stale domain and never runs it again. Not
// parallel: it takes the second node away.
func TestNodePowerLoss(t *testing.T) {
	e := require(t)
	node2 := e.secondNode(t)
	n := e.namespace(t)
	ctx := context.Background()
	first := n.startOnSecondNode("mover")

	off := time.Now()
	if err := lab.PowerOff(node2); err != nil {
		t.Fatal(err)
	}
	second := n.waitVMIOfVM("mover", 2*time.Minute, first.UID)
	moved := time.Since(off)
	if second.Status.NodeName != e.nodeName {
		t.Fatalf("after the power loss the vmi runs on %q, want %s", second.Status.NodeName, e.nodeName)
	}
	t.Logf("power loss to running on %s: %s (fencing window %s + margin %s)", e.nodeName, moved.Round(100*time.Millisecond),
		fencingWindow, 10*time.Second)
	if bound := fencingWindow + 10*time.Second /* margin */ + heartbeat + 60*time.Second; moved > bound {
		t.Errorf("the VM took %s to run again, more than %s", moved.Round(time.Second), bound)
	}
	events, err := e.kube.CoreV1().Events(n.name).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=mover"})
	if err != nil || !slices.ContainsFunc(events.Items, func(ev corev1.Event) bool {
		return ev.Reason == "NodeUnreachable" && ev.InvolvedObject.Kind == "VirtualMachine"
	}) {
		t.Errorf("no NodeUnreachable event on VM mover (err %v)", err)
	}
	node, err := e.kube.CoreV1().Nodes().Get(ctx, node2.Name, metav1.GetOptions{})
	if err != nil || nodeReady(node) || !slices.ContainsFunc(node.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == corev1.TaintNodeUnreachable
	}) {
		t.Errorf("the lost node is not NotReady and tainted unreachable: %v (err %v)", node.Spec.Taints, err)
	}

	// Power on: the node's libvirtd finds the domain defined, the agent
	// undefines it without starting it.
	if err := lab.StartNode(node2, []lab.Node{node2}); err != nil {
		t.Fatal(err)
	}
	if err := e.startAgent2(); err != nil {
		t.Fatal(err)
	}
	dom := domainName(n.name, "mover")
	n.eventually(90*time.Second, "stale domain "+dom+" removed from "+node2.Name, func() (bool, string) {
		out, err := nodeVirsh(node2, "list", "--all", "--name")
		if err != nil {
			return false, err.Error()
		}
		if st, _ := nodeVirsh(node2, "domstate", dom); strings.TrimSpace(st) == "running" {
			t.Errorf("the returning node runs %s again while the VM runs on %s", dom, e.nodeName)
		}
		return !strings.Contains(out, dom), "still defined: " + strings.TrimSpace(out)
	})
	n.eventually(60*time.Second, "node "+node2.Name+" Ready again, untainted", func() (bool, string) {
		node, err := e.kube.CoreV1().Nodes().Get(ctx, node2.Name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return nodeReady(node) && !slices.ContainsFunc(node.Spec.Taints, func(t corev1.Taint) bool {
			return t.Key == corev1.TaintNodeUnreachable
		}), fmt.Sprint(node.Spec.Taints)
	})
}

// TestNodePartition: the second node's links are cut while it runs a VM.
// Cut off from the API server and from its peers, its agent stops the guest
// by itself after the fencing window, before the brain starts the VM on the
// first node; when the links come back the node removes the stale domain.
// At no moment do both nodes run the guest. Not parallel: it takes the
// second node away.
func TestNodePartition(t *testing.T) {
	e := require(t)
	node2 := e.secondNode(t)
	n := e.namespace(t)
	n.startOnSecondNode("cut")

	under := node2.UnderlayLink()
	if out, err := exec.Command("ip", "link", "set", under, "down").CombinedOutput(); err != nil {
		t.Fatalf("cut %s: %v %s", under, err, out)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			_ = exec.Command("ip", "link", "set", under, "up").Run()
		}
	}
	defer restore()
	cut := time.Now()
	dom := domainName(n.name, "cut")
	var stoppedAt, movedAt time.Duration
	n.eventually(3*time.Minute, "vm cut running on "+e.nodeName+" after the partition", func() (bool, string) {
		on2, _ := nodeVirsh(node2, "domstate", dom)
		running2 := strings.HasPrefix(strings.TrimSpace(on2), "running")
		if !running2 && stoppedAt == 0 {
			stoppedAt = time.Since(cut)
		}
		running1 := domainState(n.name, "cut") == "running"
		if running1 && running2 {
			t.Errorf("both nodes run the guest %s at +%s", dom, time.Since(cut).Round(100*time.Millisecond))
		}
		if running1 && movedAt == 0 {
			movedAt = time.Since(cut)
		}
		return running1, fmt.Sprintf("node2 %q, first node %q", strings.TrimSpace(on2), domainState(n.name, "cut"))
	})
	t.Logf("partition: guest stopped on %s at +%s, running on %s at +%s (window %s)", node2.Name,
		stoppedAt.Round(100*time.Millisecond), e.nodeName, movedAt.Round(100*time.Millisecond), fencingWindow)
	if stoppedAt == 0 || stoppedAt > movedAt {
		t.Errorf("the cut-off node did not stop its guest before the VM ran elsewhere")
	}

	restore()
	n.eventually(2*time.Minute, "stale domain "+dom+" removed from "+node2.Name+" after the partition", func() (bool, string) {
		if st, _ := nodeVirsh(node2, "domstate", dom); strings.HasPrefix(strings.TrimSpace(st), "running") {
			t.Errorf("the node back from the partition runs %s again", dom)
		}
		out, err := nodeVirsh(node2, "list", "--all", "--name")
		return err == nil && !strings.Contains(out, dom), strings.TrimSpace(out)
	})
}

// startOnSecondNode starts VM name on the suite's second node (the first one
// cordoned meanwhile) and waits until its guest has booted there.
func (n *testNS) startOnSecondNode(name string) *kubevirtv1.VirtualMachineInstance {
	n.t.Helper()
	e, node2, ctx := n.e, n.e.node2(), context.Background()
	n.waitNodeReady(node2.Name)
	cordon := func(on bool) {
		patch := fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, on)
		if _, err := e.kube.CoreV1().Nodes().Patch(ctx, e.nodeName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			n.t.Fatalf("cordon %s: %v", e.nodeName, err)
		}
	}
	cordon(true)
	n.createVM(n.newVM(name, kubevirtv1.RunStrategyAlways, onSecondNodeToo()))
	vmi := n.waitVMIOfVM(name, 2*time.Minute)
	cordon(false)
	if vmi.Status.NodeName != node2.Name {
		n.t.Fatalf("vmi %s runs on %s, want %s (the first node was cordoned)", name, vmi.Status.NodeName, node2.Name)
	}
	n.serialOn(node2, name).expect(`NODEVIRT-GUEST-READY`, bootTimeout)
	return vmi
}
