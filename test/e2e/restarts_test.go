package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/test/lab"
)

// apiOutage is how long kube-apiserver stays away in
// TestCrossNodeRestartsKeepGuests: longer than the fencing window, so that
// only the agents' peers tell them the outage is the API server's and not
// their own partition.
const apiOutage = 20 * time.Second

// TestCrossNodeRestartsKeepGuests: with a guest on each node (the suite's
// first and second, and with E2E_NODES=3 its third), kill -9 of the brain,
// kill -9 of the second node's agent (of every node's agent in turn with
// E2E_NODES=3) and a crash of kube-apiserver
// (away for apiOutage) each leave every guest alone: after each, once the
// cluster is ready again, every VMI is Running on its node with the same
// QEMU process, and each VM has exactly one domain across the nodes;
// through the outage the nodes reach each other, and no agent fences
// itself. Not parallel: it takes the brain, the API server and the nodes'
// agents away.
func TestCrossNodeRestartsKeepGuests(t *testing.T) {
	e := require(t)
	nodes := e.restartNodes(t)
	n := e.namespace(t)
	ctx := context.Background()
	guests := []pinned{{"keep-first", e.nodeName}}
	for i, nd := range nodes {
		n.waitNodeReady(nd.Name)
		guests = append(guests, pinned{"keep-" + []string{"second", "third"}[i], nd.Name})
	}
	t.Logf("%d nodes: %s and %d in namespaces of their own", len(nodes)+1, e.nodeName, len(nodes))

	for _, g := range guests {
		n.createVMI(n.newVMI(g.name, withNodeSelector(g.node), onSecondNodeToo()))
	}
	pids := map[string]int{}
	for _, g := range guests {
		n.waitOn(g.name, g.node)
		if nd, ok := namespaced(nodes, g.node); ok {
			n.serialOn(nd.Node, g.name).expect(`NODEVIRT-GUEST-READY`, bootTimeout)
		} else {
			n.waitBooted(g.name)
		}
		if pids[g.name] = e.qemuPIDOn(nodes, n.name, g.name, g.node); pids[g.name] == 0 {
			t.Fatalf("no QEMU process for running vmi %s on %s", g.name, g.node)
		}
	}
	n.checkGuestsKept("the start", nodes, guests, pids)

	brainHealth := e.brain.flag("health-addr")
	t.Log("kill -9 the brain")
	e.brain.kill()
	if err := e.brain.start(); err != nil {
		t.Fatal(err)
	}
	n.eventually(2*time.Minute, "restarted clusterbrain ready", func() (bool, string) {
		if !e.brain.alive() {
			t.Fatalf("the restarted clusterbrain exited: %s", e.brain.tail(20))
		}
		return healthy(brainHealth), "GET /readyz on " + brainHealth + " not 200"
	})
	n.settle("the brain restart")
	n.checkGuestsKept("the brain restart", nodes, guests, pids)

	// Every namespaced node's agent; with three nodes the first node's
	// too (alone, TestNodeAgentKilled restarts it).
	restarts := nodes
	if len(nodes) > 1 {
		first := restartNode{Node: lab.Node{Name: e.nodeName}, agent: func() *daemon { return e.agent }, start: e.agent.start}
		restarts = append([]restartNode{first}, nodes...)
	}
	for _, nd := range restarts {
		t.Log("kill -9 the agent of " + nd.Name)
		killed := time.Now()
		nd.agent().kill()
		if err := nd.start(); err != nil {
			t.Fatal(err)
		}
		n.eventually(2*time.Minute, "restarted agent of "+nd.Name+" renews its lease", func() (bool, string) {
			if a := nd.agent(); !a.alive() {
				t.Fatalf("the restarted agent of %s exited: %s", nd.Name, a.tail(20))
			}
			lease, err := e.kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, nd.Name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			return lease.Spec.RenewTime != nil && lease.Spec.RenewTime.After(killed), "lease not renewed since the kill"
		})
		n.settle("the agent restart on " + nd.Name)
		n.checkGuestsKept("the agent restart on "+nd.Name, nodes, guests, pids)
	}

	// Past the fencing window an agent that reaches no peer fences itself
	// (nodeagent/agent/fence.go); during an API server outage each node
	// reaches the others' peer addresses (the first node's is on the
	// fabric's gateway, harness_test.go), so none does.
	first, err := e.kube.CoreV1().Nodes().Get(ctx, e.nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	peer := first.Annotations[identity.NodeAddressAnnotation]
	if host, _, _ := net.SplitHostPort(peer); host != e.fabric().Gateway() {
		t.Fatalf("%s advertises its peer address %q, want one on the fabric's gateway %s, which the other nodes reach",
			e.nodeName, peer, e.fabric().Gateway())
	}
	agents := []*daemon{e.agent}
	for _, nd := range nodes {
		agents = append(agents, nd.agent())
	}
	logs := map[*daemon]int64{}
	for _, d := range agents {
		logs[d] = logSize(d.logPath)
	}
	t.Logf("kube-apiserver away for %s", apiOutage)
	down := time.Now()
	if err := e.cp.RestartAPIServer(ctx, apiOutage); err != nil {
		t.Fatalf("API server outage: %v", err)
	}
	t.Logf("kube-apiserver ready again %s after it was killed (fencing window %s)", time.Since(down).Round(100*time.Millisecond), fencingWindow)
	n.settle("the API server outage")
	for d, from := range logs {
		if fenced := logLinesSince(d.logPath, from, "self-fencing"); fenced != "" {
			t.Errorf("%s fenced itself during the API server outage:\n%s", d.name, fenced)
		}
	}
	n.checkGuestsKept("the API server outage", nodes, guests, pids)
}

// pinned is a VMI pinned to a node.
type pinned struct{ name, node string }

// restartNode is one of the suite's nodes in namespaces of its own, with
// its agent.
type restartNode struct {
	lab.Node
	// agent is the node's agent now (start replaces it).
	agent func() *daemon
	// start starts the node's agent again.
	start func() error
}

// restartNodes are the namespaced nodes TestCrossNodeRestartsKeepGuests
// runs guests on beside the first: the second node, and the third with
// E2E_NODES=3 (started here when no test started it yet).
func (e *env) restartNodes(t *testing.T) []restartNode {
	t.Helper()
	nodes := []restartNode{{Node: e.secondNode(t), agent: func() *daemon { return e.agent2 }, start: e.startAgent2}}
	if e2eNodes(t) < 3 {
		return nodes
	}
	if err := e.startThirdNode(); err != nil {
		t.Fatalf("third node: %v", err)
	}
	return append(nodes, restartNode{Node: e.node3(), agent: func() *daemon { return third.agent }, start: e.startAgent3})
}

// e2eNodes is the node count E2E_NODES asks of the tests that can run on
// more than two nodes (TestCrossNodeRestartsKeepGuests): 2 (the default,
// what `make test` runs) or 3.
func e2eNodes(t *testing.T) int {
	t.Helper()
	switch v := os.Getenv("E2E_NODES"); v {
	case "", "2":
		return 2
	case "3":
		return 3
	default:
		t.Fatalf("E2E_NODES=%q: want 2 or 3", v)
		return 0
	}
}

// namespaced returns the namespaced node of nodes named name.
func namespaced(nodes []restartNode, name string) (restartNode, bool) {
	for _, nd := range nodes {
		if nd.Name == name {
			return nd, true
		}
	}
	return restartNode{}, false
}

// logSize is the size of a daemon's log, where lines written next start.
func logSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}

// logLinesSince returns the lines of the log at path from offset on that
// contain match.
func logLinesSince(path string, from int64, match string) string {
	data, err := os.ReadFile(path)
	if err != nil || int64(len(data)) < from {
		return fmt.Sprintf("(log %s unreadable from offset %d: %v)", path, from, err)
	}
	var lines []string
	for _, l := range strings.Split(string(data[from:]), "\n") {
		if strings.Contains(l, match) {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n")
}

// settle waits until the cluster is ready again, then gives the brain and
// the agents time to resync every VMI: a wrong adoption (a restart, a
// second domain, a failure) shows within it.
func (n *testNS) settle(after string) {
	n.t.Helper()
	if missing := n.e.waitReady(context.Background(), 3*time.Minute); missing != "" {
		n.t.Fatalf("not ready after %s: %s", after, missing)
	}
	time.Sleep(15 * time.Second)
}

// checkGuestsKept checks that every guest still runs where it ran, as the
// same QEMU process, with exactly one domain across the nodes.
func (n *testNS) checkGuestsKept(after string, nodes []restartNode, guests []pinned, pids map[string]int) {
	n.t.Helper()
	t, e := n.t, n.e
	host, err := virsh("list", "--all", "--name")
	if err != nil {
		t.Fatal(err)
	}
	all := strings.Fields(host)
	lists := []string{e.nodeName + ": " + strings.Join(strings.Fields(host), " ")}
	for _, nd := range nodes {
		out, err := nodeVirsh(nd.Node, "list", "--all", "--name")
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, strings.Fields(out)...)
		lists = append(lists, nd.Name+": "+strings.Join(strings.Fields(out), " "))
	}
	for _, g := range guests {
		vmi, err := n.getVMI(g.name)
		if err != nil {
			t.Fatal(err)
		}
		if vmi.Status.Phase != kubevirtv1.Running || vmi.Status.NodeName != g.node {
			t.Errorf("after %s vmi %s is %s on %q, want Running on %s: %s", after, g.name, vmi.Status.Phase,
				vmi.Status.NodeName, g.node, n.diagnoseVMI(g.name, vmi, nil))
		}
		if pid := e.qemuPIDOn(nodes, n.name, g.name, g.node); pid != pids[g.name] {
			t.Errorf("after %s vmi %s: QEMU pid %d on %s, was %d: the guest was stopped or restarted", after, g.name, pid, g.node, pids[g.name])
		}
		dom, count := domainName(n.name, g.name), 0
		for _, d := range all {
			if d == dom {
				count++
			}
		}
		if count != 1 {
			t.Errorf("after %s vmi %s has %d domains across the %d nodes (%s), want 1", after, g.name, count,
				len(nodes)+1, strings.Join(lists, "; "))
		}
	}
}

// qemuPIDOn is the pid of the VMI's QEMU process on node (the suite's first
// node or one of nodes, whose processes share the host's pid namespace), 0
// when it does not run.
func (e *env) qemuPIDOn(nodes []restartNode, ns, vmi, node string) int {
	nd, ok := namespaced(nodes, node)
	if !ok {
		return qemuPID(ns, vmi)
	}
	data, err := e.readOn(nd.Node, "/run/libvirt/qemu/"+domainName(ns, vmi)+".pid")
	if err != nil {
		return 0
	}
	return livePID(data)
}
