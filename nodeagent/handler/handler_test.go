package handler

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

const (
	startTimeout = 90 * time.Second // create → Running on two shared cores
	bootTimeout  = 120 * time.Second
	testMAC      = "02:00:5e:4e:56:01"
)

func uintp(u uint) *uint    { return &u }
func int64p(i int64) *int64 { return &i }

// guestVMI boots the test guest from the PVC boot, with a cloud-init seed
// whose user data comes from the Secret seed, and a bridge NIC on the
// Multus network br.
func guestVMI(name string, paused bool) *v1.VirtualMachineInstance {
	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.VirtualMachineInstanceSpec{
			TerminationGracePeriodSeconds: int64p(60),
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("128Mi")}},
				Devices: v1.Devices{
					Disks: []v1.Disk{
						{Name: "boot", BootOrder: uintp(1), DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
						{Name: "seed", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
					},
					Interfaces: []v1.Interface{{Name: "lan", MacAddress: testMAC,
						InterfaceBindingMethod: v1.InterfaceBindingMethod{Bridge: &v1.InterfaceBridge{}}}},
				},
			},
			Networks: []v1.Network{{Name: "lan", NetworkSource: v1.NetworkSource{Multus: &v1.MultusNetwork{NetworkName: "br"}}}},
			Volumes: []v1.Volume{
				{Name: "boot", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
					PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "boot"}}}},
				{Name: "seed", VolumeSource: v1.VolumeSource{CloudInitNoCloud: &v1.CloudInitNoCloudSource{
					UserDataSecretRef: &k8sv1.LocalObjectReference{Name: "seed"}}}},
			},
		},
	}
	if paused {
		s := v1.StartStrategyPaused
		vmi.Spec.StartStrategy = &s
	}
	return vmi
}

func qemuPID(t *testing.T, vmi *v1.VirtualMachineInstance) int {
	t.Helper()
	pid, err := strconv.Atoi(vmi.Annotations[AnnotationQEMUPID])
	if err != nil || pid <= 0 {
		t.Fatalf("annotation %s = %q", AnnotationQEMUPID, vmi.Annotations[AnnotationQEMUPID])
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("qemu pid %d: %v", pid, err)
	}
	return pid
}

// TestGuestLifecycle boots a guest from a CSI volume through the handler
// and drives it the way users do: console, pause/unpause, an agent
// restart around the running guest, a second console, graceful delete.
func TestGuestLifecycle(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	n := newNode(t)
	diskSize := n.bootVolume(ctx, "boot")
	n.bridgeNetwork(ctx, "br")
	if _, err := n.kube.CoreV1().Secrets(n.ns).Create(ctx, &k8sv1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "seed", Namespace: n.ns},
		Data:       map[string][]byte{"userdata": []byte("#!/bin/sh\necho from-secret-$((40+2))\n")},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// KVM hangs on these machines: emulation comes from the KubeVirt CR,
	// which also shows that the CR's useEmulation is honoured.
	if _, err := n.virt.KubeVirts.Create(ctx, &v1.KubeVirt{
		ObjectMeta: metav1.ObjectMeta{Name: "kubevirt", Namespace: n.ns},
		Spec: v1.KubeVirtSpec{Configuration: v1.KubeVirtConfiguration{
			DeveloperConfiguration: &v1.DeveloperConfiguration{UseEmulation: true}}},
	}); err != nil {
		t.Fatal(err)
	}
	h, stop := n.handler(false)

	start := time.Now()
	vmi := n.schedule(ctx, guestVMI("guest", true))
	vmi = n.waitVMI(ctx, "guest", startTimeout, "Running and paused", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running && isTrue(v, v1.VirtualMachineInstancePaused)
	})
	t.Logf("create → Running (paused) in %v", time.Since(start).Round(time.Millisecond))
	pid := qemuPID(t, vmi)
	if got := vmi.Annotations[AnnotationEmulation]; got != "true" {
		t.Errorf("annotation %s = %q, want true", AnnotationEmulation, got)
	}
	if !slices.Contains(vmi.Finalizers, Finalizer) {
		t.Errorf("finalizers %v lack %s", vmi.Finalizers, Finalizer)
	}
	if c := condition(vmi, v1.VirtualMachineInstanceReady); c == nil || c.Status != k8sv1.ConditionFalse {
		t.Errorf("Ready while paused: %+v", c)
	}
	// Its disk is a node-local filesystem volume of the hostpath CSI
	// driver, which a migration copies (KubeVirt would say
	// DisksNotMigratable).
	if c := condition(vmi, v1.VirtualMachineInstanceIsMigratable); c == nil || c.Status != k8sv1.ConditionTrue {
		t.Errorf("LiveMigratable: %+v", c)
	}
	if len(vmi.Status.Interfaces) != 1 || vmi.Status.Interfaces[0].Name != "lan" || vmi.Status.Interfaces[0].MAC != testMAC {
		t.Errorf("status.interfaces %+v", vmi.Status.Interfaces)
	}
	if vmi.Status.NodeName != n.name {
		t.Errorf("status.nodeName %q", vmi.Status.NodeName)
	}
	tap, err := netlink.LinkByName(tapName(vmi.UID, "lan"))
	if err != nil {
		t.Fatalf("tap: %v", err)
	}
	if br, err := netlink.LinkByName(n.bridge); err != nil || tap.Attrs().MasterIndex != br.Attrs().Index {
		t.Errorf("tap %s is not on bridge %s (%v)", tap.Attrs().Name, n.bridge, err)
	}

	// The console is attached before the guest runs: nothing is missed.
	cc := n.consoleClient(h)
	conn, err := cc.Console(ctx, n.ns, "guest")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	log := guest.ReadConsole(conn)
	if err := cc.Do(ctx, n.ns, "guest", "unpause"); err != nil {
		t.Fatal(err)
	}
	n.waitVMI(ctx, "guest", 30*time.Second, "unpaused and Ready", func(v *v1.VirtualMachineInstance) bool {
		return condition(v, v1.VirtualMachineInstancePaused) == nil && isTrue(v, v1.VirtualMachineInstanceReady)
	})
	log.ExpectExact(t, "NODEVIRT-GUEST-BOOTED", bootTimeout)
	t.Logf("create → guest booted in %v", time.Since(start).Round(time.Millisecond))
	log.ExpectExact(t, "NODEVIRT-NIC eth0 "+testMAC, 60*time.Second)
	log.ExpectExact(t, fmt.Sprintf("NODEVIRT-DISK vda %d", diskSize), 60*time.Second)
	log.ExpectExact(t, "from-secret-42", 60*time.Second)
	log.ExpectExact(t, "NODEVIRT-GUEST-READY", 60*time.Second)
	log.Login(t, conn, 30*time.Second)
	if _, err := conn.Write([]byte("echo hello\n")); err != nil {
		t.Fatal(err)
	}
	log.ExpectExact(t, "hello", 30*time.Second)

	// Pause and unpause through the control endpoints.
	if err := cc.Do(ctx, n.ns, "guest", "pause"); err != nil {
		t.Fatal(err)
	}
	paused := n.waitVMI(ctx, "guest", 30*time.Second, "paused", func(v *v1.VirtualMachineInstance) bool {
		return isTrue(v, v1.VirtualMachineInstancePaused)
	})
	if c := condition(paused, v1.VirtualMachineInstancePaused); c.Reason != "PausedByUser" {
		t.Errorf("Paused reason %q", c.Reason)
	}
	if err := cc.Do(ctx, n.ns, "guest", "unpause"); err != nil {
		t.Fatal(err)
	}
	n.waitVMI(ctx, "guest", 30*time.Second, "unpaused", func(v *v1.VirtualMachineInstance) bool {
		return condition(v, v1.VirtualMachineInstancePaused) == nil && isTrue(v, v1.VirtualMachineInstanceReady)
	})

	// The agent goes away and comes back: the guest never notices.
	stop()
	if !log.Ended(10 * time.Second) {
		t.Error("console stream outlived the agent")
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("qemu died with the agent: %v", err)
	}
	h, stop = n.handler(false)
	vmi = n.waitVMI(ctx, "guest", 30*time.Second, "Running after the restart", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running && isTrue(v, v1.VirtualMachineInstanceReady)
	})
	if got := qemuPID(t, vmi); got != pid {
		t.Fatalf("qemu pid %d after the restart, was %d", got, pid)
	}
	cc = n.consoleClient(h)
	first, err := cc.Console(ctx, n.ns, "guest")
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	firstLog := guest.ReadConsole(first)
	if _, err := first.Write([]byte("echo again-$((1+1))\n")); err != nil {
		t.Fatal(err)
	}
	firstLog.ExpectExact(t, "again-2", 30*time.Second)
	// A second console takes over; the first one ends.
	second, err := cc.Console(ctx, n.ns, "guest")
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	secondLog := guest.ReadConsole(second)
	if !firstLog.Ended(10 * time.Second) {
		t.Error("first console still open after a second one")
	}
	if _, err := second.Write([]byte("echo hello\n")); err != nil {
		t.Fatal(err)
	}
	secondLog.ExpectExact(t, "hello", 30*time.Second)
	// Reset: the guest boots again, the VMI stays Running with the same QEMU.
	if err := cc.Do(ctx, n.ns, "guest", "reset"); err != nil {
		t.Fatal(err)
	}
	secondLog.ExpectExact(t, "NODEVIRT-GUEST-READY", bootTimeout)
	if v := n.waitVMI(ctx, "guest", 10*time.Second, "Running", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running
	}); qemuPID(t, v) != pid {
		t.Errorf("reset changed the qemu pid")
	}
	// VNC: QEMU's RFB greeting through the stream.
	vnc, err := cc.VNC(ctx, n.ns, "guest")
	if err != nil {
		t.Fatal(err)
	}
	vnc.SetReadDeadline(time.Now().Add(30 * time.Second))
	greeting := make([]byte, 12)
	if _, err := io.ReadFull(vnc, greeting); err != nil || !strings.HasPrefix(string(greeting), "RFB 003.") {
		t.Errorf("vnc greeting %q, %v", greeting, err)
	}
	vnc.Close()
	// Status updates resumed: a pause is seen by the new agent.
	if err := cc.Do(ctx, n.ns, "guest", "pause"); err != nil {
		t.Fatal(err)
	}
	n.waitVMI(ctx, "guest", 30*time.Second, "paused by the new agent", func(v *v1.VirtualMachineInstance) bool {
		return isTrue(v, v1.VirtualMachineInstancePaused)
	})

	// Graceful delete (of a paused guest: it is resumed for the ACPI
	// button): Succeeded, then gone, the domain undefined.
	w, err := n.virt.VMIs.Watch(ctx, n.ns, metav1.ListOptions{FieldSelector: "metadata.name=guest"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	delStart := time.Now()
	if err := n.virt.VMIs.Delete(ctx, n.ns, "guest", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	secondLog.Expect(t, "NODEVIRT-GUEST-POWEROFF", 60*time.Second)
	var phases []v1.VirtualMachineInstancePhase
	timeout := time.After(90 * time.Second)
watch:
	for {
		select {
		case ev := <-w.ResultChan():
			v, ok := ev.Object.(*v1.VirtualMachineInstance)
			if !ok {
				continue
			}
			if len(phases) == 0 || phases[len(phases)-1] != v.Status.Phase {
				phases = append(phases, v.Status.Phase)
			}
			if ev.Type == "DELETED" {
				break watch
			}
		case <-timeout:
			t.Fatalf("vmi not gone within 90s; phases %v", phases)
		}
	}
	t.Logf("delete → gone in %v, phases %v", time.Since(delStart).Round(time.Millisecond), phases)
	if !slices.Contains(phases, v1.Succeeded) {
		t.Errorf("phases %v: never Succeeded", phases)
	}
	if _, err := n.lv.Lookup(ctx, n.ns+"_guest"); !errors.Is(err, launcher.ErrNotFound) {
		t.Errorf("domain after delete: %v", err)
	}
	if _, err := netlink.LinkByName(tap.Attrs().Name); err == nil {
		t.Errorf("tap %s outlived the vmi", tap.Attrs().Name)
	}
	rec := httptest.NewRecorder()
	metrics.Default().Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	for _, op := range []string{"attach", "detach"} {
		if want := fmt.Sprintf(`nodevirt_cni_operation_duration_seconds_count{op=%q,result="ok"}`, op); !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if _, err := os.Stat(h.vmDir(vmi.UID)); !os.IsNotExist(err) {
		t.Errorf("state dir of the vmi: %v", err)
	}
}

// TestKilledQEMUFails kills the QEMU of a guest booted from an ephemeral
// overlay of a PVC: the VMI fails with a reason, and everything is cleaned
// up while the VMI stays.
func TestKilledQEMUFails(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n := newNode(t)
	n.bootVolume(ctx, "base")
	h, _ := n.handler(true)
	vmi := ephemeralVMI("victim")
	n.schedule(ctx, vmi)
	running := n.waitVMI(ctx, "victim", startTimeout, "Running", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running && v.Annotations[AnnotationQEMUPID] != ""
	})
	pid := qemuPID(t, running)
	overlay := h.vmDir(running.UID) + "/ephemeral-root.qcow2"
	if _, err := os.Stat(overlay); err != nil {
		t.Errorf("ephemeral overlay: %v", err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	failed := n.waitVMI(ctx, "victim", 60*time.Second, "Failed and cleaned up", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Failed && !slices.Contains(v.Finalizers, Finalizer)
	})
	if failed.Status.Reason != ReasonQEMUCrashed {
		t.Errorf("status.reason %q, want %s", failed.Status.Reason, ReasonQEMUCrashed)
	}
	if c := condition(failed, v1.VirtualMachineInstanceReady); c == nil || c.Status != k8sv1.ConditionFalse || c.Reason != v1.GuestNotRunningReason {
		t.Errorf("Ready after the crash: %+v", c)
	}
	if _, ok := failed.Annotations[AnnotationQEMUPID]; ok {
		t.Errorf("qemu pid annotation kept on a failed vmi")
	}
	if _, err := n.lv.Lookup(ctx, n.ns+"_victim"); !errors.Is(err, launcher.ErrNotFound) {
		t.Errorf("domain of the failed vmi: %v", err)
	}
	if _, err := os.Stat(overlay); !os.IsNotExist(err) {
		t.Errorf("overlay of the failed vmi: %v", err)
	}
}

// TestRefusedSpecs: what cannot run fails with a precise message, what is
// missing waits with a condition saying what.
func TestRefusedSpecs(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	n := newNode(t)
	h, _ := n.handler(true)
	base := func(name string) *v1.VirtualMachineInstance {
		return &v1.VirtualMachineInstance{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: v1.VirtualMachineInstanceSpec{
				Domain: v1.DomainSpec{Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}}},
			},
		}
	}
	podNet := base("podnet")
	podNet.Spec.Networks = []v1.Network{*v1.DefaultPodNetwork()}
	podNet.Spec.Domain.Devices.Interfaces = []v1.Interface{{Name: "default",
		InterfaceBindingMethod: v1.InterfaceBindingMethod{Masquerade: &v1.InterfaceMasquerade{}}}}
	gpu := base("gpu")
	gpu.Spec.Domain.Devices.GPUs = []v1.GPU{{Name: "g", DeviceName: "nvidia.com/X"}}
	noClaim := base("noclaim")
	noClaim.Spec.Domain.Devices.Disks = []v1.Disk{{Name: "d", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}}
	noClaim.Spec.Volumes = []v1.Volume{{Name: "d", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "nowhere"}}}}}

	for _, c := range []struct {
		vmi    *v1.VirtualMachineInstance
		phase  v1.VirtualMachineInstancePhase
		reason string
		msg    string
	}{
		{podNet, v1.Failed, "FailedCreate", "the pod network"},
		{gpu, v1.Failed, "FailedCreate", "spec.domain.devices.gpus: not supported"},
		{noClaim, v1.Scheduled, "Waiting", "persistentvolumeclaim " + n.ns + "/nowhere does not exist"},
	} {
		n.schedule(ctx, c.vmi)
		got := n.waitVMI(ctx, c.vmi.Name, 30*time.Second, "refused", func(v *v1.VirtualMachineInstance) bool {
			s := condition(v, v1.VirtualMachineInstanceSynchronized)
			return v.Status.Phase == c.phase && s != nil && s.Status == k8sv1.ConditionFalse
		})
		s := condition(got, v1.VirtualMachineInstanceSynchronized)
		if s.Reason != c.reason || !strings.Contains(s.Message, c.msg) {
			t.Errorf("%s: Synchronized %s %q, want %s containing %q", c.vmi.Name, s.Reason, s.Message, c.reason, c.msg)
		}
		if _, err := n.lv.Lookup(ctx, n.ns+"_"+c.vmi.Name); !errors.Is(err, launcher.ErrNotFound) {
			t.Errorf("%s: a domain exists: %v", c.vmi.Name, err)
		}
	}
	// Controls of a VMI without a domain are conflicts, of an unknown one
	// not found.
	cc := n.consoleClient(h)
	if err := cc.Do(ctx, n.ns, "noclaim", "pause"); !errors.Is(err, console.ErrNotRunning) {
		t.Errorf("pause of a vmi without domain: %v", err)
	}
	if err := cc.Do(ctx, n.ns, "nothere", "pause"); !errors.Is(err, console.ErrNotFound) {
		t.Errorf("pause of an unknown vmi: %v", err)
	}
}

// ephemeralVMI boots an ephemeral overlay of the PVC base, without graphics.
func ephemeralVMI(name string) *v1.VirtualMachineInstance {
	return &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}},
				Devices: v1.Devices{
					AutoattachGraphicsDevice: new(bool),
					Disks:                    []v1.Disk{{Name: "root", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}},
				},
			},
			Volumes: []v1.Volume{{Name: "root", VolumeSource: v1.VolumeSource{Ephemeral: &v1.EphemeralVolumeSource{
				PersistentVolumeClaim: &k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "base"}}}}},
		},
	}
}

// TestOrphanCleanedAfterRestart: a VMI removed (finalizer and all) while
// the agent was down leaves a running domain; the restarted agent finds it
// by its state and removes it. A domain the agent did not make is left
// alone.
func TestOrphanCleanedAfterRestart(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n := newNode(t)
	n.bootVolume(ctx, "base")
	h, stop := n.handler(true)
	n.schedule(ctx, ephemeralVMI("orphan"))
	running := n.waitVMI(ctx, "orphan", startTimeout, "Running", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running && v.Annotations[AnnotationQEMUPID] != ""
	})
	pid := qemuPID(t, running)
	stop()

	running.Finalizers = nil
	if _, err := n.virt.VMIs.Update(ctx, running); err != nil {
		t.Fatal(err)
	}
	if err := n.virt.VMIs.Delete(ctx, n.ns, "orphan", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n.waitVMI(ctx, "orphan", 30*time.Second, "gone", func(v *v1.VirtualMachineInstance) bool { return v == nil })
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("qemu died while the agent was down: %v", err)
	}

	// Another node agent on the same libvirtd (no state for this domain)
	// must not touch it.
	other := *n
	other.stateDir = reachableDir(t, "nodevirt-handler-other-")
	other.name = n.name + "-other"
	_, stopOther := other.handler(true)
	time.Sleep(2 * time.Second)
	stopOther()
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("an agent without state for the domain killed it: %v", err)
	}

	n.handler(true)
	deadline := time.Now().Add(60 * time.Second)
	testkit.Poll(t, 60*time.Second, "the orphan domain to go", func() (bool, error) {
		_, err := n.lv.Lookup(ctx, n.ns+"_orphan")
		return errors.Is(err, launcher.ErrNotFound), err
	})
	// The state goes right after the domain (taps are detached first).
	testkit.Poll(t, time.Until(deadline), "the state of the orphan to go", func() (bool, error) {
		_, err := os.Stat(h.vmDir(running.UID))
		return os.IsNotExist(err), err
	})
}
