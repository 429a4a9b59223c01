package guest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// bootTimeout is generous: the two cores are shared and TCG is slow under load.
const bootTimeout = 60 * time.Second

func expect(t *testing.T, ctx context.Context, in *Instance, marker string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, bootTimeout)
	defer cancel()
	line, err := in.Expect(ctx, marker)
	if err != nil {
		t.Fatal(err)
	}
	return line
}

// TestBootDiskUnderQEMU boots the extlinux disk through the BIOS with a
// NoCloud seed on an IDE CD-ROM, talks to its console and presses its
// power button.
func TestBootDiskUnderQEMU(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	disk, err := BootDisk(ctx, DiskSpec{})
	if err != nil {
		t.Fatal(err)
	}
	userData := "#!/bin/sh\n# nodevirt.ip=10.11.12.13/24\necho from-user-data-$((6 * 7))\n"
	seed, err := NoCloudSeed(t.TempDir(), userData, "", "")
	if err != nil {
		t.Fatal(err)
	}
	const mac = "52:54:00:12:34:56"
	start := time.Now()
	in, err := Run(ctx, RunSpec{
		Disks: []Disk{{Path: disk, Snapshot: true}, {Path: seed, CDROM: true}},
		NICs:  []NIC{{MAC: mac}, {}},
		Log:   t.Output(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Kill()

	expect(t, ctx, in, "NODEVIRT-GUEST-BOOTED")
	t.Logf("booted from disk in %v", time.Since(start))
	if line := expect(t, ctx, in, "NODEVIRT-NIC eth0"); line != "NODEVIRT-NIC eth0 "+mac {
		t.Errorf("NIC line %q, want MAC %s", line, mac)
	}
	expect(t, ctx, in, "NODEVIRT-NIC eth1 52:54:")
	if line := expect(t, ctx, in, "NODEVIRT-DISK sr0"); line != "NODEVIRT-DISK sr0 "+fileSize(t, seed) {
		t.Errorf("CD-ROM line %q", line)
	}
	if line := expect(t, ctx, in, "NODEVIRT-DISK vda"); line != "NODEVIRT-DISK vda 67108864" {
		t.Errorf("disk line %q", line)
	}
	expect(t, ctx, in, "NODEVIRT-SEED sr0 cidata")
	expect(t, ctx, in, "NODEVIRT-USERDATA-BEGIN")
	expect(t, ctx, in, "# nodevirt.ip=10.11.12.13/24")
	expect(t, ctx, in, "NODEVIRT-USERDATA-END")
	expect(t, ctx, in, "NODEVIRT-IP eth0 10.11.12.13/24")
	expect(t, ctx, in, "from-user-data-42")
	expect(t, ctx, in, "NODEVIRT-USERDATA-EXIT 0")
	expect(t, ctx, in, "NODEVIRT-GUEST-READY")

	cmdCtx, cancel := context.WithTimeout(ctx, bootTimeout)
	defer cancel()
	out, err := in.Command(cmdCtx, "echo hello")
	if err != nil || out != "hello" {
		t.Errorf("echo hello gave %q, %v", out, err)
	}
	out, err = in.Command(cmdCtx, "ip -4 -o addr show dev eth0")
	if err != nil || !strings.Contains(out, "inet 10.11.12.13/24") {
		t.Errorf("eth0 address: %q, %v", out, err)
	}
	if out, err := in.Command(cmdCtx, "ls /nonexistent"); err == nil || !strings.Contains(out, "No such file") {
		t.Errorf("failing command gave %q, %v", out, err)
	}
	// Typed directly, as a person would.
	if err := in.Send("echo $((1000 + 337))"); err != nil {
		t.Fatal(err)
	}
	expect(t, ctx, in, "1337")

	if err := in.Powerdown(); err != nil {
		t.Fatal(err)
	}
	waitCtx, cancelWait := context.WithTimeout(ctx, bootTimeout)
	defer cancelWait()
	if err := in.Wait(waitCtx); err != nil {
		t.Fatalf("after the power button: %v", err)
	}
	if !strings.Contains(in.Output(), "NODEVIRT-GUEST-POWEROFF") {
		t.Error("guest exited without its shutdown marker")
	}
	t.Logf("boot, console and ACPI shutdown took %v", time.Since(start))
}

// TestDirectBootCustomGuest boots a kernel and a custom initramfs directly,
// on a q35 machine with a config drive on a virtio-scsi CD-ROM, a real
// iproute2 binary, the bridge module and a NIC on a tap in a network
// namespace, and stops it with Kill.
func TestDirectBootCustomGuest(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	vmlinuz, _, err := Kernel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ipPath, err := exec.LookPath("ip")
	if err != nil {
		t.Fatal(err)
	}
	initrd, err := Initramfs(ctx, Spec{
		Files:   map[string]string{ipPath: "/usr/sbin/ip"},
		Modules: []string{"bridge"},
		Init:    "/usr/sbin/ip link add br0 type bridge && /usr/sbin/ip -o link show br0 && echo custom-init-done",
	})
	if err != nil {
		t.Fatal(err)
	}
	seed, err := ConfigDriveSeed(t.TempDir(), "plain user data, not a script\n", "", "")
	if err != nil {
		t.Fatal(err)
	}
	// The guest's NIC is a tap in a throwaway namespace, addressed 10.99.0.1.
	ns := fmt.Sprintf("nodevirt-guest-test-%d", os.Getpid())
	for _, args := range [][]string{
		{"netns", "add", ns},
		{"-n", ns, "tuntap", "add", "tap0", "mode", "tap"},
		{"-n", ns, "addr", "add", "10.99.0.1/24", "dev", "tap0"},
		{"-n", ns, "link", "set", "tap0", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
		if args[0] == "netns" {
			t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		}
	}
	in, err := Run(ctx, RunSpec{
		Kernel: vmlinuz, Initramfs: initrd, Cmdline: "nodevirt.ip=10.99.0.2/24",
		NetNS:   "/run/netns/" + ns,
		Machine: "q35",
		Disks:   []Disk{{Path: seed, CDROM: true, Format: "raw"}}, // on virtio-scsi, as q35 needs
		NICs:    []NIC{{MAC: "52:54:00:ab:cd:ef", Tap: "tap0"}},
		Log:     t.Output(),
	})
	if err != nil {
		t.Fatal(err)
	}
	expect(t, ctx, in, "NODEVIRT-GUEST-BOOTED")
	expect(t, ctx, in, "NODEVIRT-NIC eth0 52:54:00:ab:cd:ef")
	expect(t, ctx, in, "NODEVIRT-SEED sr0 config-2")
	expect(t, ctx, in, "plain user data, not a script")
	expect(t, ctx, in, "NODEVIRT-IP eth0 10.99.0.2/24")
	if line := expect(t, ctx, in, "br0:"); !strings.Contains(line, "link/ether") {
		t.Errorf("bridge line %q", line)
	}
	expect(t, ctx, in, "custom-init-done")
	expect(t, ctx, in, "NODEVIRT-INIT-EXIT 0")
	if strings.Contains(in.Output(), "NODEVIRT-USERDATA-EXIT") {
		t.Error("user-data without #! was run")
	}
	if strings.Contains(in.Output(), "NODEVIRT-MODULE-FAILED") {
		t.Error("a module failed to load")
	}
	cmdCtx, cancel := context.WithTimeout(ctx, bootTimeout)
	defer cancel()
	if out, err := in.Command(cmdCtx, "/usr/sbin/ip -V"); err != nil || !strings.Contains(out, "iproute2") {
		t.Errorf("real ip in the guest: %q, %v", out, err)
	}
	if out, err := in.Command(cmdCtx, "ping -c 1 -W 10 10.99.0.1"); err != nil || !strings.Contains(out, "1 packets received") {
		t.Errorf("guest to tap in its namespace: %q, %v", out, err)
	}
	if status, err := in.Monitor("info status"); err != nil || !strings.Contains(status, "running") {
		t.Errorf("monitor info status: %q, %v", status, err)
	}
	if err := in.Kill(); err != nil {
		t.Fatal(err)
	}
	if !in.Exited() {
		t.Error("QEMU still runs after Kill")
	}
	if err := in.Kill(); err != nil {
		t.Errorf("second Kill: %v", err)
	}
}

func fileSize(t *testing.T, path string) string {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return strconv.FormatInt(st.Size(), 10)
}
