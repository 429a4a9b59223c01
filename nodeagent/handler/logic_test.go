package handler

import (
	"fmt"
	"net"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

func TestStoppedPhase(t *testing.T) {
	h := &Handler{stopping: map[types.UID]bool{}}
	running := &v1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{UID: "u1"}}
	deleting := running.DeepCopy()
	deleting.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	off := func(state launcher.State, reason string) launcher.DomainInfo {
		return launcher.DomainInfo{State: state, Reason: reason}
	}
	for _, c := range []struct {
		name   string
		vmi    *v1.VirtualMachineInstance
		info   launcher.DomainInfo
		found  bool
		phase  v1.VirtualMachineInstancePhase
		reason string
	}{
		{"guest powered off", running, off(launcher.StateShutoff, "shutdown"), true, v1.Succeeded, ""},
		{"qemu killed", running, off(launcher.StateShutoff, "crashed"), true, v1.Failed, ReasonQEMUCrashed},
		{"qemu failed", running, off(launcher.StateShutoff, "failed"), true, v1.Failed, ReasonQEMUCrashed},
		{"guest panic", running, off(launcher.StateCrashed, "panicked"), true, v1.Failed, ReasonGuestPanic},
		{"virsh destroy", running, off(launcher.StateShutoff, "destroyed"), true, v1.Failed, ReasonDestroyed},
		{"destroyed after grace", deleting, off(launcher.StateShutoff, "destroyed"), true, v1.Succeeded, ""},
		{"domain gone", running, launcher.DomainInfo{}, false, v1.Failed, ReasonDomainLost},
		{"domain gone while deleting", deleting, launcher.DomainInfo{}, false, v1.Succeeded, ""},
		{"libvirtd lost the reason", running, off(launcher.StateShutoff, "unknown"), true, v1.Failed, ReasonStopped},
	} {
		phase, reason, msg := h.stoppedPhase(c.vmi, c.info, c.found)
		if phase != c.phase || reason != c.reason || msg == "" {
			t.Errorf("%s: %s %q %q, want %s %q", c.name, phase, reason, msg, c.phase, c.reason)
		}
	}
	h.stopping["u1"] = true
	if phase, _, _ := h.stoppedPhase(running, off(launcher.StateShutoff, "destroyed"), true); phase != v1.Succeeded {
		t.Errorf("destroyed after a requested shutdown: %s", phase)
	}
}

func TestRemainingGrace(t *testing.T) {
	now := time.Now()
	vmi := &v1.VirtualMachineInstance{}
	if g := remainingGrace(vmi, now); g != DefaultGracePeriod {
		t.Errorf("default grace %v", g)
	}
	vmi.Spec.TerminationGracePeriodSeconds = int64p(20)
	vmi.DeletionTimestamp = &metav1.Time{Time: now.Add(-5 * time.Second)}
	if g := remainingGrace(vmi, now); g != 15*time.Second {
		t.Errorf("grace 20s deleted 5s ago: %v", g)
	}
	vmi.DeletionTimestamp = &metav1.Time{Time: now.Add(-time.Minute)}
	if g := remainingGrace(vmi, now); g != 0 {
		t.Errorf("grace long over: %v", g)
	}
}

func TestTapName(t *testing.T) {
	a, b := tapName("uid-1", "lan"), tapName("uid-1", "lan")
	if a != b || len(a) > 15 {
		t.Errorf("tap names %q %q (max 15 bytes, stable)", a, b)
	}
	if tapName("uid-1", "wan") == a || tapName("uid-2", "lan") == a {
		t.Error("tap names collide")
	}
}

func TestSetConditionKeepsTransitionTime(t *testing.T) {
	vmi := &v1.VirtualMachineInstance{}
	setCondition(vmi, v1.VirtualMachineInstanceReady, true, "", "")
	first := conditionOf(vmi, v1.VirtualMachineInstanceReady).LastTransitionTime
	first.Time = first.Add(-time.Hour)
	conditionOf(vmi, v1.VirtualMachineInstanceReady).LastTransitionTime = first
	setCondition(vmi, v1.VirtualMachineInstanceReady, true, "", "still")
	if c := conditionOf(vmi, v1.VirtualMachineInstanceReady); !c.LastTransitionTime.Equal(&first) || c.Message != "still" {
		t.Errorf("unchanged status moved the transition time: %+v", c)
	}
	setCondition(vmi, v1.VirtualMachineInstanceReady, false, "Paused", "")
	if c := conditionOf(vmi, v1.VirtualMachineInstanceReady); c.LastTransitionTime.Equal(&first) || c.Status != k8sv1.ConditionFalse {
		t.Errorf("status change kept the transition time: %+v", c)
	}
	setPhase(vmi, v1.Running)
	setPhase(vmi, v1.Running)
	if len(vmi.Status.PhaseTransitionTimestamps) != 1 {
		t.Errorf("phase transitions %v", vmi.Status.PhaseTransitionTimestamps)
	}
}

func TestPermanent(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("convert: %w", &domain.FieldError{Path: "spec.x", Reason: "bad"}), true},
		{fmt.Errorf("convert: %w", fmt.Errorf("gpus: %w", domain.ErrNotSupported)), true},
		{fmt.Errorf("iface: %w", errPodNetwork), true},
		{fmt.Errorf("%w: claim not bound", errWaiting), false},
		{launcher.ErrDisconnected, false},
	} {
		if got := permanent(c.err); got != c.want {
			t.Errorf("permanent(%v) = %v", c.err, got)
		}
	}
}

func TestHostDisk(t *testing.T) {
	dir := t.TempDir()
	if p, block, err := hostDisk(dir); err != nil || block || p != filepath.Join(dir, DiskImageName) {
		t.Errorf("directory volume: %q %v %v", p, block, err)
	}
	if p, block, err := hostDisk("/dev/null"); err != nil || block || p != "/dev/null" {
		// a character device is not a block disk
		t.Errorf("/dev/null: %q %v %v", p, block, err)
	}
}

func TestInterfaceStatusWithAgent(t *testing.T) {
	vmi := &v1.VirtualMachineInstance{}
	vmi.Spec.Domain.Devices.Interfaces = []v1.Interface{
		{Name: "lan", MacAddress: "02:00:00:00:00:01"},
		{Name: "pod", MacAddress: "02:00:00:00:00:02"},
	}
	leases := func(*v1.VirtualMachineInstance, map[string]string) map[string]net.IP {
		return map[string]net.IP{"pod": net.ParseIP("10.0.2.2")}
	}
	agent := []launcher.GuestInterface{
		{Name: "eth0", MAC: "02:00:00:00:00:01", IP: "192.168.1.5", IPs: []string{"fd00::5", "192.168.1.5"}},
		{Name: "eth1", MAC: "02:00:00:00:00:02", IP: "fd00::6", IPs: []string{"fd00::6", "10.0.2.2"}},
	}
	got := interfaceStatus(vmi, nil, leases, agent)
	if len(got) != 2 || got[0].IP != "192.168.1.5" || !slices.Equal(got[0].IPs, []string{"fd00::5", "192.168.1.5"}) ||
		got[0].InterfaceName != "eth0" || got[0].InfoSource != "domain, guest-agent" {
		t.Fatalf("agent addresses: %+v", got)
	}
	if got[1].IP != "10.0.2.2" || !slices.Equal(got[1].IPs, []string{"10.0.2.2", "fd00::6"}) || got[1].InterfaceName != "eth1" {
		t.Fatalf("lease stays primary: %+v", got[1])
	}
	// Not asked this time: what the agent said is kept.
	vmi.Status.Interfaces = got
	kept := interfaceStatus(vmi, nil, leases, nil)
	if !reflect.DeepEqual(kept, got) {
		t.Fatalf("kept %+v, want %+v", kept, got)
	}
	// No agent: its addresses go, the lease stays.
	gone := interfaceStatus(vmi, nil, leases, []launcher.GuestInterface{})
	if gone[0].IP != "" || len(gone[0].IPs) != 0 || gone[0].InterfaceName != "" || gone[0].InfoSource != "domain" ||
		gone[1].IP != "10.0.2.2" || !slices.Equal(gone[1].IPs, []string{"10.0.2.2"}) {
		t.Fatalf("without agent: %+v", gone)
	}
}

func TestAgentSupport(t *testing.T) {
	vmi := &v1.VirtualMachineInstance{}
	var all []v1.GuestAgentCommandInfo
	for _, c := range requiredAgentCommands {
		all = append(all, v1.GuestAgentCommandInfo{Name: c, Enabled: true})
	}
	agentSupport(vmi, all[:3])
	c := conditionOf(vmi, v1.VirtualMachineInstanceUnsupportedAgent)
	if c == nil || c.Status != k8sv1.ConditionTrue || !strings.Contains(c.Message, "guest-get-osinfo") {
		t.Fatalf("three commands: %+v", c)
	}
	all[len(all)-1].Enabled = false
	agentSupport(vmi, all)
	if c := conditionOf(vmi, v1.VirtualMachineInstanceUnsupportedAgent); c == nil || c.Message != "missing or disabled: guest-get-osinfo" {
		t.Fatalf("disabled command: %+v", c)
	}
	all[len(all)-1].Enabled = true
	agentSupport(vmi, all)
	if c := conditionOf(vmi, v1.VirtualMachineInstanceUnsupportedAgent); c != nil {
		t.Fatalf("every command: %+v", c)
	}
	agentSupport(vmi, nil) // an agent that lists nothing is not judged
	if c := conditionOf(vmi, v1.VirtualMachineInstanceUnsupportedAgent); c != nil {
		t.Fatalf("no list: %+v", c)
	}
}
