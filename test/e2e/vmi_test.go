package e2e

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestLabReady: the node registers Ready and the HyperConverged reports
// Available, as `make lab` waits for.
func TestLabReady(t *testing.T) {
	e := require(t)
	if e.notReady != "" {
		t.Fatalf("lab not ready after 90s: %s", e.notReady)
	}
	node, err := e.kube.CoreV1().Nodes().Get(context.Background(), e.nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !nodeReady(node) {
		t.Errorf("node %s is not Ready", e.nodeName)
	}
}

// The shared guest: one booted VMI with inline cloud-init user-data, for
// the read-only checks (console, boot markers, inline user-data).
var shared struct {
	once sync.Once
	ns   string
	err  error
}

const (
	sharedVMI      = "shared"
	sharedUserData = "#!/bin/sh\necho E2E-INLINE-$((6 * 7))\n"
)

func (e *env) sharedGuest(t *testing.T) *testNS {
	t.Helper()
	shared.once.Do(func() {
		shared.err = fmt.Errorf("creating the shared guest failed in another test")
		name := "e2e-" + e.run + "-shared"
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"nodevirt.io/e2e": e.run}}}
		if _, err := e.kube.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{}); err != nil {
			shared.err = err
			return
		}
		n := &testNS{e: e, t: t, name: name}
		if _, err := e.virt.VMIs.Create(context.Background(), n.newVMI(sharedVMI, withUserData(sharedUserData))); err != nil {
			shared.err = fmt.Errorf("create vmi %s/%s: %w", name, sharedVMI, err)
			return
		}
		shared.ns, shared.err = name, nil
	})
	if shared.err != nil {
		t.Fatalf("shared guest: %v", shared.err)
	}
	// The shared namespace outlives the test: the suite's teardown deletes it.
	return &testNS{e: e, t: t, name: shared.ns}
}

// TestVMIConsole: a VMI boots on the node under TCG, its status says where
// and what runs, and its console answers a typed command.
func TestVMIConsole(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.sharedGuest(t)
	vmi := n.waitRunning(sharedVMI)
	if vmi.Status.NodeName != e.nodeName {
		t.Errorf("status.nodeName = %q, want %q", vmi.Status.NodeName, e.nodeName)
	}
	if st := domainState(n.name, sharedVMI); st != "running" {
		t.Errorf("domain %s state %q, want running", domainName(n.name, sharedVMI), st)
	}
	if qemuPID(n.name, sharedVMI) == 0 {
		t.Errorf("no QEMU process for %s", domainName(n.name, sharedVMI))
	}
	dom, err := domainXML(n.name, sharedVMI)
	if err != nil {
		t.Fatal(err)
	}
	if dom.Type != "qemu" {
		t.Errorf("domain type %q, want qemu (TCG: the HyperConverged asks for emulation)", dom.Type)
	}
	serial := n.waitBooted(sharedVMI)
	if !serial.contains(`NODEVIRT-DISK vda 67108864`) {
		t.Errorf("the guest did not report its 64 MiB root disk as vda")
	}
	c := n.console(sharedVMI)
	c.login()
	c.send("echo hello\r")
	c.expect(`(?m)^hello\r?$`, 20*time.Second)
}

// TestCloudInitInline: inline NoCloud user-data reaches the guest, which
// prints it and runs it (the script's arithmetic only happens when run).
func TestCloudInitInline(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.sharedGuest(t)
	n.waitRunning(sharedVMI)
	s := n.serial(sharedVMI)
	s.expect(`NODEVIRT-SEED \w+ cidata`, bootTimeout)
	s.expect(`NODEVIRT-USERDATA-BEGIN`, 10*time.Second)
	s.expect(`echo E2E-INLINE-\$\(\(6 \* 7\)\)`, 10*time.Second)
	s.expect(`NODEVIRT-USERDATA-END`, 10*time.Second)
	s.expect(`(?m)^E2E-INLINE-42\r?$`, 30*time.Second)
	s.expect(`NODEVIRT-USERDATA-EXIT 0`, 10*time.Second)
}

// TestCloudInitSecret: user-data from a Secret (userDataSecretRef) reaches
// the guest.
func TestCloudInitSecret(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "userdata", Namespace: n.name},
		Data: map[string][]byte{"userdata": []byte("#!/bin/sh\necho E2E-SECRET-$((6 * 7))\n")}}
	if _, err := e.kube.CoreV1().Secrets(n.name).Create(context.Background(), secret, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	n.createVMI(n.newVMI("fromsecret", withUserDataSecret("userdata")))
	n.waitRunning("fromsecret")
	s := n.serial("fromsecret")
	s.expect(`NODEVIRT-USERDATA-BEGIN`, bootTimeout)
	s.expect(`echo E2E-SECRET-\$\(\(6 \* 7\)\)`, 10*time.Second)
	s.expect(`NODEVIRT-USERDATA-END`, 10*time.Second)
	s.expect(`(?m)^E2E-SECRET-42\r?$`, 30*time.Second)
}

// vmiAction calls a VMI subresource (pause, unpause, ...) as virtctl does.
func (n *testNS) vmiAction(name, action string) {
	n.t.Helper()
	if _, err := n.e.kube.Discovery().ServerResourcesForGroupVersion(subresourcesGV); err != nil {
		n.t.Fatalf("%s %s/%s: the %s API is not served (clusterbrain subresources role, issue 9): %v", action, n.name, name, subresourcesGV, err)
	}
	err := n.e.kube.Discovery().RESTClient().Put().
		AbsPath("/apis", subresourcesGV, "namespaces", n.name, "virtualmachineinstances", name, action).
		SetHeader("Content-Type", "application/json").Body([]byte("{}")).Do(context.Background()).Error()
	if err != nil {
		n.t.Fatalf("%s %s/%s: %v", action, n.name, name, err)
	}
}

func pausedState(n *testNS, name string, paused bool) func(*kubevirtv1.VirtualMachineInstance) bool {
	return func(v *kubevirtv1.VirtualMachineInstance) bool {
		want := "running"
		if paused {
			want = "paused"
		}
		return v.Status.Phase == kubevirtv1.Running && hasCondition(v, kubevirtv1.VirtualMachineInstancePaused) == paused &&
			domainState(n.name, name) == want
	}
}

// TestStartStrategyPaused: a VMI with startStrategy Paused runs with its
// vCPUs stopped (condition Paused, nothing on the console) until unpaused.
func TestStartStrategyPaused(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	n.createVMI(n.newVMI("paused", withStartPaused()))
	n.waitVMI("paused", 2*time.Minute, "Running with condition Paused and a paused domain", pausedState(n, "paused", true))
	s := n.serial("paused")
	time.Sleep(3 * time.Second)
	if s.contains(`NODEVIRT-GUEST-BOOTED`) {
		t.Fatalf("the guest booted although it was started paused")
	}
	n.vmiAction("paused", "unpause")
	n.waitVMI("paused", 30*time.Second, "unpaused (no Paused condition, domain running)", pausedState(n, "paused", false))
	s.expect(`NODEVIRT-GUEST-READY`, bootTimeout)
}

// TestPauseUnpause: pausing stops the guest (condition Paused, domain
// paused); unpausing resumes it and its console answers again.
func TestPauseUnpause(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	n.createVMI(n.newVMI("pausable"))
	n.waitRunning("pausable")
	n.waitBooted("pausable")
	c := n.console("pausable")
	c.login()
	n.vmiAction("pausable", "pause")
	n.waitVMI("pausable", 30*time.Second, "paused (condition Paused, domain paused)", pausedState(n, "pausable", true))
	c.send("echo still-$((40 + 2))\r")
	time.Sleep(2 * time.Second)
	c.mu.Lock()
	answered := regexpMatch(`(?m)^still-42\r?$`, string(c.out[c.cursor:]))
	c.mu.Unlock()
	if answered {
		t.Fatalf("the paused guest answered on its console")
	}
	n.vmiAction("pausable", "unpause")
	n.waitVMI("pausable", 30*time.Second, "unpaused", pausedState(n, "pausable", false))
	c.expect(`(?m)^still-42\r?$`, 20*time.Second)
}

// TestGracefulDelete: deleting a VMI shuts its guest down through ACPI
// within the grace period, and with a zero grace period stops it at once;
// either way the VMI ends Succeeded and its domain is removed.
func TestGracefulDelete(t *testing.T) {
	t.Parallel()
	e := require(t)
	for _, tc := range []struct {
		name     string
		grace    int64
		graceful bool
	}{
		{"grace-60s", 60, true},
		{"grace-0", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			n := e.namespace(t)
			n.createVMI(n.newVMI("deleted", withGracePeriod(tc.grace)))
			n.waitRunning("deleted")
			s := n.waitBooted("deleted")
			pid := qemuPID(n.name, "deleted")
			start := time.Now()
			phases := n.deleteAndWatch("deleted", nil, 90*time.Second)
			took := time.Since(start)
			if !containsPhase(phases, kubevirtv1.Succeeded) {
				t.Errorf("phases seen while deleting: %v, want Succeeded among them", phases)
			}
			if processAlive(pid) {
				t.Errorf("QEMU pid %d still runs after the VMI is gone", pid)
			}
			poweredOff := s.contains(`NODEVIRT-ACPI-POWER-BUTTON`)
			switch {
			case tc.graceful && !poweredOff:
				t.Errorf("the guest never saw the ACPI power button (deletion took %s)", took.Round(time.Second))
			case tc.graceful && took > 45*time.Second:
				t.Errorf("graceful deletion took %s: the guest's ACPI shutdown was not used", took.Round(time.Second))
			case !tc.graceful && took > 20*time.Second:
				t.Errorf("deletion with a zero grace period took %s", took.Round(time.Second))
			}
			t.Logf("deleted in %s, phases %v, guest saw power button: %v", took.Round(100*time.Millisecond), phases, poweredOff)
		})
	}
}

func containsPhase(phases []kubevirtv1.VirtualMachineInstancePhase, p kubevirtv1.VirtualMachineInstancePhase) bool {
	for _, q := range phases {
		if q == p {
			return true
		}
	}
	return false
}

// deleteAndWatch deletes a VMI while watching it, and returns every phase
// it showed until it was gone (and its domain undefined).
func (n *testNS) deleteAndWatch(name string, grace *int64, timeout time.Duration) []kubevirtv1.VirtualMachineInstancePhase {
	n.t.Helper()
	vmi, err := n.getVMI(name)
	if err != nil {
		n.t.Fatalf("vmi %s/%s: %v", n.name, name, err)
	}
	rec := n.recordPhases()
	n.deleteVMI(name, grace)
	n.waitGone(name, timeout)
	// The watch may lag the poll that saw the VMI gone.
	n.eventually(10*time.Second, "the watch to see the deletion", func() (bool, string) {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return rec.deleted[vmi.UID], "no DELETED event yet"
	})
	return rec.of(vmi.UID)
}

// TestKilledQEMU: when the guest's QEMU process is killed, the VMI goes
// Failed.
func TestKilledQEMU(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	n.createVMI(n.newVMI("victim"))
	vmi := n.waitRunning("victim")
	pid := qemuPID(n.name, "victim")
	if pid == 0 {
		t.Fatalf("no QEMU process for the running VMI: %s", n.diagnoseVMI("victim", vmi, nil))
	}
	if a := vmi.Annotations["nodevirt.io/qemu-pid"]; a != "" && a != strconv.Itoa(pid) {
		t.Errorf("annotation nodevirt.io/qemu-pid = %s, libvirt says %d", a, pid)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	n.waitVMI("victim", 60*time.Second, "Failed after QEMU was killed", func(v *kubevirtv1.VirtualMachineInstance) bool {
		return v.Status.Phase == kubevirtv1.Failed
	})
	n.deleteAndWatch("victim", nil, 60*time.Second)
}
