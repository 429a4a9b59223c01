package e2e

import (
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestNodeAgentKilled: kill -9 of the node agent leaves every guest running
// (same QEMU process); the restarted agent adopts them, the VMIs stay
// Running, and it still drives them afterwards (pause through the API,
// deletion).
//
// It runs alone (not parallel): the other tests need the agent.
func TestNodeAgentKilled(t *testing.T) {
	e := require(t)
	n := e.namespace(t)
	// A bare VMI, and a VM with a NIC on a bridge (its tap must survive too).
	nad, br := n.bridgeNetwork("survivor-net")
	names := []string{"survivor-a", "survivor-b"}
	n.createVMI(n.newVMI(names[0]))
	n.createVM(n.newVM(names[1], kubevirtv1.RunStrategyAlways, withBridge(nad)))
	pids := map[string]int{}
	for _, name := range names {
		n.waitRunning(name)
		n.waitBooted(name)
		if pids[name] = qemuPID(n.name, name); pids[name] == 0 {
			t.Fatalf("no QEMU process for running vmi %s", name)
		}
	}
	healthAddr := e.agent.flag("health-addr")
	e.agent.kill()
	t.Logf("nodeagent killed")
	time.Sleep(3 * time.Second)
	for _, name := range names {
		if !processAlive(pids[name]) {
			t.Errorf("QEMU of %s (pid %d) died with the agent", name, pids[name])
		}
	}
	if err := e.agent.start(); err != nil {
		t.Fatal(err)
	}
	n.eventually(60*time.Second, "restarted nodeagent ready", func() (bool, string) {
		if !e.agent.alive() {
			t.Fatalf("the restarted nodeagent exited: %s", e.agent.tail(20))
		}
		return healthy(healthAddr), "GET /readyz on " + healthAddr + " not 200"
	})
	// Give the restarted agent time to resync every VMI: a wrong adoption
	// (restart, failure) shows within it.
	time.Sleep(10 * time.Second)
	for _, name := range names {
		vmi, err := n.getVMI(name)
		if err != nil {
			t.Fatal(err)
		}
		if vmi.Status.Phase != kubevirtv1.Running {
			t.Errorf("vmi %s is %s after the agent restart: %s", name, vmi.Status.Phase, n.diagnoseVMI(name, vmi, nil))
		}
		if pid := qemuPID(n.name, name); pid != pids[name] {
			t.Errorf("vmi %s: QEMU pid %d after the agent restart, was %d: the guest was restarted", name, pid, pids[name])
		}
	}
	if ports := bridgePorts(br); len(ports) != 1 {
		t.Errorf("after the agent restart bridge %s has ports %v, want the bridged guest's tap", br, ports)
	}
	// The adopted guests are still driven: a deletion after the restart
	// stops one and removes its domain.
	phases := n.deleteAndWatch(names[0], nil, 90*time.Second)
	if !containsPhase(phases, kubevirtv1.Succeeded) {
		t.Errorf("deleting adopted vmi %s: phases %v, want Succeeded", names[0], phases)
	}
	if pid := qemuPID(n.name, names[1]); pid != pids[names[1]] {
		t.Errorf("deleting %s disturbed %s (QEMU pid %d, was %d)", names[0], names[1], pid, pids[names[1]])
	}
}
