package launcher

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/test/guest"
)

// waitEvent waits for an event of the domain matching typ (and reason when
// not empty), skipping others.
func waitEvent(t *testing.T, m *Manager, name string, typ EventType, reason string, timeout time.Duration) Event {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case e := <-m.Events():
			if e.Domain == name && e.Type == typ && (reason == "" || e.Reason == reason) {
				return e
			}
		case <-deadline:
			t.Fatalf("no %s (%s) event for %s within %s", typ, reason, name, timeout)
		}
	}
}

func makeTap(t *testing.T, name string) {
	t.Helper()
	if out, err := exec.Command("ip", "tuntap", "add", "dev", name, "mode", "tap").CombinedOutput(); err != nil {
		t.Fatalf("make tap: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "link", "del", name).Run() })
}

// bootVMI is a VMI of the test guest: an ephemeral overlay on the cached boot
// disk, an empty disk, a NoCloud seed whose user data runs a script, a
// bridge NIC with a MAC from the spec, limits for the cgroup.
func bootVMI(name string) *v1.VirtualMachineInstance {
	paused := v1.StartStrategyPaused
	return &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "launcher-it", UID: types.UID(testUUID(name))},
		Spec: v1.VirtualMachineInstanceSpec{
			StartStrategy: &paused,
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{
					Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("128Mi")},
					Limits: k8sv1.ResourceList{
						k8sv1.ResourceMemory: resource.MustParse("128Mi"),
						k8sv1.ResourceCPU:    resource.MustParse("1"),
					},
				},
				Devices: v1.Devices{
					Disks: []v1.Disk{
						{Name: "boot", BootOrder: uintp(1), DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
						{Name: "scratch", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
						{Name: "seed", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
					},
					Interfaces: []v1.Interface{{
						Name: "lan", MacAddress: "02:00:5e:10:20:30",
						InterfaceBindingMethod: v1.InterfaceBindingMethod{Bridge: &v1.InterfaceBridge{}},
					}},
					Rng: &v1.Rng{},
				},
			},
			Networks: []v1.Network{{Name: "lan", NetworkSource: v1.NetworkSource{Multus: &v1.MultusNetwork{NetworkName: "br"}}}},
			Volumes: []v1.Volume{
				{Name: "boot", VolumeSource: v1.VolumeSource{Ephemeral: &v1.EphemeralVolumeSource{
					PersistentVolumeClaim: &k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "boot"}}}},
				{Name: "scratch", VolumeSource: v1.VolumeSource{EmptyDisk: &v1.EmptyDiskSource{Capacity: resource.MustParse("16Mi")}}},
				{Name: "seed", VolumeSource: v1.VolumeSource{CloudInitNoCloud: &v1.CloudInitNoCloudSource{
					UserData: "#!/bin/sh\necho from-user-data-$((40+2))\n"}}},
			},
		},
	}
}

func uintp(u uint) *uint { return &u }

// testUUID derives a UUID from a name (domains' UUIDs come from VMI UIDs,
// so test VMIs need distinct ones).
func testUUID(name string) string {
	h := uint64(1469598103934665603)
	for _, c := range name {
		h = (h ^ uint64(c)) * 1099511628211
	}
	return fmt.Sprintf("7e57c0de-0000-4000-8000-%012x", h&0xffffffffffff)
}

func TestBootRealGuest(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	uri := libvirttest.Ensure(t)
	bootDisk, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		t.Fatal(err)
	}
	m, err := Open(Config{URI: uri, ShutdownRetry: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() }) // m is replaced below; this closes the last one, after the undefine below

	vmi := bootVMI(fmt.Sprintf("boot-%d", os.Getpid()))
	tap := fmt.Sprintf("nvlt%d", os.Getpid()%100000)
	makeTap(t, tap)
	env := domain.Env{
		Emulation: true,
		StateDir:  libvirttest.StateDir(t),
		Disks:     map[string]domain.DiskSource{"boot": {Path: bootDisk, Format: domain.FormatRaw}},
		Taps:      map[string]domain.Tap{"lan": {Dev: tap}},
	}
	dom, err := domain.Convert(vmi, env)
	if err != nil {
		t.Fatal(err)
	}
	if err := domain.Prepare(ctx, vmi, env); err != nil {
		t.Fatal(err)
	}
	name := dom.Name
	t.Cleanup(func() { m.Undefine(context.Background(), name) })

	if err := m.Create(ctx, dom, StartOptions{Paused: domain.StartPaused(vmi)}); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventStarted, "booted", 30*time.Second)
	waitEvent(t, m, name, EventSuspended, "", 30*time.Second)
	info, err := m.Lookup(ctx, name)
	if err != nil || info.State != StatePaused || info.PID == 0 || info.VMI.UID != string(vmi.UID) {
		t.Fatalf("started paused: %+v %v", info, err)
	}

	cons, err := m.Console(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer cons.Close()
	log := guest.ReadConsole(cons)
	if err := m.Unpause(ctx, name); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventResumed, "unpaused", 30*time.Second)

	log.Expect(t, "NODEVIRT-GUEST-BOOTED", 2*time.Minute)
	if line := log.Expect(t, "NODEVIRT-NIC", 10*time.Second); !strings.HasSuffix(line, "02:00:5e:10:20:30") {
		t.Errorf("guest NIC %q does not carry the spec's MAC", line)
	}
	if line := log.Expect(t, "NODEVIRT-DISK vdb", 10*time.Second); !strings.HasSuffix(line, strconv.Itoa(16<<20)) {
		t.Errorf("empty disk: %q, want 16 MiB", line)
	}
	log.Expect(t, "NODEVIRT-SEED vdc cidata", 20*time.Second)
	log.Expect(t, "from-user-data-42", 20*time.Second)
	log.Expect(t, "NODEVIRT-GUEST-READY", 30*time.Second)
	log.Login(t, cons, 30*time.Second)
	if _, err := io.WriteString(cons, "echo console-$((6*7))-works\n"); err != nil {
		t.Fatal(err)
	}
	log.Expect(t, "console-42-works", 20*time.Second)

	// A second session takes the console over; the first one ends.
	cons2, err := m.Console(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer cons2.Close()
	if !log.Ended(10 * time.Second) {
		t.Error("first console session did not end when a second one opened")
	}
	cons.Close()
	log = guest.ReadConsole(cons2)

	// The domain outlives the Manager that made it: a new one adopts it.
	pid := m.mustLookup(t, name).PID
	m.Close()
	m, err = Open(Config{URI: uri, ShutdownRetry: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	adopted := m.mustLookup(t, name)
	if adopted.State != StateRunning || adopted.PID != pid || !adopted.HasVMI || adopted.VMI.Name != vmi.Name {
		t.Fatalf("adopted %+v, want running pid %d of %s", adopted, pid, vmi.Name)
	}
	checkCgroup(t, pid)
	if sock, err := m.VNCSocket(ctx, name); err != nil {
		t.Error(err)
	} else if st, err := os.Stat(sock); err != nil || st.Mode()&os.ModeSocket == 0 {
		t.Errorf("vnc socket %s: %v", sock, err)
	}

	if err := m.Pause(ctx, name); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventSuspended, "paused", 30*time.Second)
	if err := m.Unpause(ctx, name); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventResumed, "unpaused", 30*time.Second)

	// Reset reboots without the guest's help; the QEMU process stays.
	if err := m.Reset(ctx, name); err != nil {
		t.Fatal(err)
	}
	log.Expect(t, "NODEVIRT-GUEST-READY", 2*time.Minute)
	if got := m.mustLookup(t, name).PID; got != pid {
		t.Errorf("reset changed the QEMU pid %d -> %d", pid, got)
	}

	// Graceful shutdown: the guest sees the ACPI power button and powers
	// off well within the grace period; nothing is destroyed.
	start := time.Now()
	if err := m.Shutdown(ctx, name, 90*time.Second); err != nil {
		t.Fatal(err)
	}
	log.Expect(t, "NODEVIRT-ACPI-POWER-BUTTON", 10*time.Second)
	waitEvent(t, m, name, EventStopped, "shutdown", 30*time.Second)
	t.Logf("graceful shutdown took %s", time.Since(start))
	if info := m.mustLookup(t, name); info.State != StateShutoff || info.Reason != "shutdown" {
		t.Fatalf("after shutdown: %+v", info)
	}

	// Start again; QEMU killed from outside shows as a failure.
	if err := m.Start(ctx, name, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventStarted, "booted", 30*time.Second)
	pid = m.mustLookup(t, name).PID
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	e := waitEvent(t, m, name, EventStopped, "", 30*time.Second)
	if e.Reason != "failed" && e.Reason != "crashed" {
		t.Errorf("QEMU killed: stopped (%s), want failed or crashed", e.Reason)
	}
	t.Logf("QEMU killed: %v", e)

	if err := m.Start(ctx, name, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventStarted, "booted", 30*time.Second)
	if err := m.Destroy(ctx, name); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventStopped, "destroyed", 30*time.Second)
	if err := m.Undefine(ctx, name); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, name, EventUndefined, "removed", 30*time.Second)
}

func (m *Manager) mustLookup(t *testing.T, name string) DomainInfo {
	t.Helper()
	info, err := m.Lookup(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return info
}

// checkCgroup reads the QEMU process's cgroup limits: memory (128 MiB limit
// plus the default overhead) and CPU (1 CPU = quota of one period).
func checkCgroup(t *testing.T, pid int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	paths := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 {
			for _, ctl := range strings.Split(parts[1], ",") {
				paths[ctl] = parts[2]
			}
		}
	}
	mem, ok := paths["memory"]
	if !ok || !strings.Contains(mem, "machine") {
		t.Fatalf("QEMU %d is not in a machine cgroup: %s", pid, b)
	}
	// The domain's limit is on the domain's cgroup, the parent of QEMU's
	// emulator cgroup when libvirt made one.
	want := int64(128<<20) + domain.DefaultMemoryOverhead
	found := false
	for dir := mem; dir != "/" && dir != "."; dir = filepath.Dir(dir) {
		v, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", dir, "memory.limit_in_bytes"))
		if err == nil && strings.TrimSpace(string(v)) == strconv.FormatInt(want, 10) {
			found = true
			break
		}
	}
	if !found {
		t.Errorf("no memory.limit_in_bytes of %d above %s", want, mem)
	}
}
