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

// TestCrossNodeRestartsKeepGuests: with a guest on each of two nodes, kill
// -9 of the brain, kill -9 of the second node's agent and a crash of
// kube-apiserver (away for apiOutage) each leave every guest alone: after
// each, once the cluster is ready again, every VMI is Running on its node
// with the same QEMU process, and each VM has exactly one domain across
// both nodes; through the outage the nodes reach each other, and neither
// agent fences itself. Not parallel: it takes the brain, the API server
// and the second node's agent away.
func TestCrossNodeRestartsKeepGuests(t *testing.T) {
	e := require(t)
	node2 := e.secondNode(t)
	n := e.namespace(t)
	ctx := context.Background()
	n.waitNodeReady(node2.Name)

	guests := []struct{ name, node string }{{"keep-first", e.nodeName}, {"keep-second", node2.Name}}
	for _, g := range guests {
		n.createVMI(n.newVMI(g.name, withNodeSelector(g.node), onSecondNodeToo()))
	}
	pids := map[string]int{}
	for _, g := range guests {
		n.waitOn(g.name, g.node)
		if g.node == node2.Name {
			n.serialOn(node2, g.name).expect(`NODEVIRT-GUEST-READY`, bootTimeout)
		} else {
			n.waitBooted(g.name)
		}
		if pids[g.name] = e.qemuPIDOn(node2, n.name, g.name, g.node); pids[g.name] == 0 {
			t.Fatalf("no QEMU process for running vmi %s on %s", g.name, g.node)
		}
	}
	n.checkGuestsKept("the start", node2, guests, pids)

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
	n.checkGuestsKept("the brain restart", node2, guests, pids)

	t.Log("kill -9 the agent of " + node2.Name)
	killed := time.Now()
	e.agent2.kill()
	if err := e.startAgent2(); err != nil {
		t.Fatal(err)
	}
	n.eventually(2*time.Minute, "restarted agent of "+node2.Name+" renews its lease", func() (bool, string) {
		if !e.agent2.alive() {
			t.Fatalf("the restarted agent of %s exited: %s", node2.Name, e.agent2.tail(20))
		}
		lease, err := e.kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, node2.Name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return lease.Spec.RenewTime != nil && lease.Spec.RenewTime.After(killed), "lease not renewed since the kill"
	})
	n.settle("the agent restart on " + node2.Name)
	n.checkGuestsKept("the agent restart on "+node2.Name, node2, guests, pids)

	// Past the fencing window an agent that reaches no peer fences itself
	// (nodeagent/agent/fence.go); during an API server outage each node
	// reaches the other's peer address (the first node's is on the
	// fabric's gateway, harness_test.go), so neither does.
	first, err := e.kube.CoreV1().Nodes().Get(ctx, e.nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	peer := first.Annotations[identity.NodeAddressAnnotation]
	if host, _, _ := net.SplitHostPort(peer); host != e.fabric().Gateway() {
		t.Fatalf("%s advertises its peer address %q, want one on the fabric's gateway %s, which %s reaches",
			e.nodeName, peer, e.fabric().Gateway(), node2.Name)
	}
	logs := map[*daemon]int64{}
	for _, d := range []*daemon{e.agent, e.agent2} {
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
	n.checkGuestsKept("the API server outage", node2, guests, pids)
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
func (n *testNS) checkGuestsKept(after string, node2 lab.Node, guests []struct{ name, node string }, pids map[string]int) {
	n.t.Helper()
	t, e := n.t, n.e
	host, err := virsh("list", "--all", "--name")
	if err != nil {
		t.Fatal(err)
	}
	second, err := nodeVirsh(node2, "list", "--all", "--name")
	if err != nil {
		t.Fatal(err)
	}
	all := append(strings.Fields(host), strings.Fields(second)...)
	for _, g := range guests {
		vmi, err := n.getVMI(g.name)
		if err != nil {
			t.Fatal(err)
		}
		if vmi.Status.Phase != kubevirtv1.Running || vmi.Status.NodeName != g.node {
			t.Errorf("after %s vmi %s is %s on %q, want Running on %s: %s", after, g.name, vmi.Status.Phase,
				vmi.Status.NodeName, g.node, n.diagnoseVMI(g.name, vmi, nil))
		}
		if pid := e.qemuPIDOn(node2, n.name, g.name, g.node); pid != pids[g.name] {
			t.Errorf("after %s vmi %s: QEMU pid %d on %s, was %d: the guest was stopped or restarted", after, g.name, pid, g.node, pids[g.name])
		}
		dom, count := domainName(n.name, g.name), 0
		for _, d := range all {
			if d == dom {
				count++
			}
		}
		if count != 1 {
			t.Errorf("after %s vmi %s has %d domains across both nodes (first: %q, second: %q), want 1", after, g.name, count,
				strings.TrimSpace(host), strings.TrimSpace(second))
		}
	}
}

// qemuPIDOn is the pid of the VMI's QEMU process on node (the suite's first
// node or node2, whose processes share the host's pid namespace), 0 when
// it does not run.
func (e *env) qemuPIDOn(node2 lab.Node, ns, vmi, node string) int {
	if node != node2.Name {
		return qemuPID(ns, vmi)
	}
	data, err := e.readOn(node2, "/run/libvirt/qemu/"+domainName(ns, vmi)+".pid")
	if err != nil {
		return 0
	}
	return livePID(data)
}
