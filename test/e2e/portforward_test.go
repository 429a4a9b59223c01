package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"image/png"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// sshGuestFiles are what the ssh guest carries beside busybox: Debian's
// dropbear (package dropbear-bin) as the server and OpenSSH's scp (package
// openssh-client) for the remote end of scp's legacy protocol.
var sshGuestFiles = map[string]string{"/usr/sbin/dropbear": "/usr/sbin/dropbear", "/usr/bin/scp": "/usr/bin/scp"}

// sshUserData takes the pod network address by DHCP, installs key as
// root's authorized key and starts dropbear on port 22.
func sshUserData(key string) string {
	return `#!/bin/sh
cat >/run/lease.sh <<'LEASE'
#!/bin/sh
[ "$1" = bound ] || exit 0
ip addr flush dev "$interface"
ip addr add "$ip/$mask" dev "$interface"
[ -n "$router" ] && ip route add default via "$router"
echo "E2E-LEASE $ip"
LEASE
chmod +x /run/lease.sh
udhcpc -i eth0 -n -q -t 10 -T 3 -s /run/lease.sh
mkdir -p /root/.ssh /etc/dropbear /dev/pts /tmp
mount -t devpts devpts /dev/pts 2>/dev/null
chmod 700 /root /root/.ssh
echo '` + key + `' >/root/.ssh/authorized_keys
chmod 600 /root/.ssh/authorized_keys
/usr/sbin/dropbear -R -p 22 && echo E2E-SSHD-STARTED
`
}

// TestUpstreamVirtctlPortForwardSSH reaches a guest's sshd through the
// portforward subresource with upstream virtctl: port-forward to a local
// port, ssh with a command, scp to the guest and back, a closed port
// refused; then vnc screenshot and reset of the same guest.
func TestUpstreamVirtctlPortForwardSSH(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	u := n.upstreamVirtctl()
	for _, bin := range []string{"/usr/sbin/dropbear", "/usr/bin/scp", "/usr/bin/ssh", "/usr/bin/ssh-keygen"} {
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("%s: %v (make deps installs dropbear-bin and openssh-client)", bin, err)
		}
	}
	dir := t.TempDir()
	key := filepath.Join(dir, "id_ed25519")
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key).CombinedOutput(); err != nil {
		t.Fatalf("ssh-keygen: %v: %s", err, out)
	}
	pub, err := os.ReadFile(key + ".pub")
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, err := guest.BootDisk(ctx, guest.DiskSpec{Initramfs: guest.Spec{Files: sshGuestFiles}})
	if err != nil {
		t.Fatalf("ssh guest image: %v", err)
	}
	const vm = "sshguest"
	disk := n.e.path("disks", n.name, vm+".raw")
	if err := copyDisk(src, disk); err != nil {
		t.Fatal(err)
	}
	always := kubevirtv1.RunStrategyAlways
	n.createVM(&kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: vm, Namespace: n.name},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &always,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
				Spec: vmiSpec(disk, withPodNetwork(), withUserData(sshUserData(strings.TrimSpace(string(pub)))), withGracePeriod(5))}}})
	n.waitVMIOfVM(vm, 2*time.Minute)
	serial := n.serial(vm)
	serial.expect(`E2E-LEASE [0-9.]+`, bootTimeout)
	serial.expect(`E2E-SSHD-STARTED`, 60*time.Second)

	// port-forward: the local port answers with the guest's SSH banner.
	_, port, _ := net.SplitHostPort(freeAddr())
	pfCtx, pfCancel := context.WithCancel(context.Background())
	defer pfCancel()
	pf := u.command(pfCtx, "port-forward", "vm/"+vm, port+":22")
	var pfOut bytes.Buffer
	pf.Stdout, pf.Stderr = &pfOut, &pfOut
	if err := pf.Start(); err != nil {
		t.Fatal(err)
	}
	banner := ""
	_ = testkit.Wait(300*time.Millisecond, 2*time.Minute, "the guest's SSH banner", func() (bool, error) {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+port, 5*time.Second)
		if err != nil {
			return false, err
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(60 * time.Second))
		banner, _ = bufio.NewReader(c).ReadString('\n')
		return banner != "", nil
	})
	pfCancel()
	pf.Wait()
	if !strings.HasPrefix(banner, "SSH-2.0-dropbear") {
		t.Fatalf("virtctl port-forward %s:22 gave banner %q\n%s", port, banner, pfOut.String())
	}

	sshOpts := []string{"-i", key, "--local-ssh-opts=-oStrictHostKeyChecking=no", "--local-ssh-opts=-oUserKnownHostsFile=/dev/null",
		"--local-ssh-opts=-oLogLevel=ERROR"}
	out := u.run(3*time.Minute, append([]string{"ssh", "root@vm/" + vm, "--command", "echo $((6*7))-over-ssh; cat /proc/cmdline"}, sshOpts...)...)
	if !strings.Contains(out, "42-over-ssh") || !strings.Contains(out, "console=ttyS0") {
		t.Errorf("virtctl ssh ran no command in the guest:\n%s", out)
	}

	// scp there and back, with the legacy protocol (the guest has scp, no
	// sftp server).
	payload := []byte(fmt.Sprintf("scp payload %d\n%s", time.Now().UnixNano(), strings.Repeat("nodevirt ", 4096)))
	local := filepath.Join(dir, "payload")
	if err := os.WriteFile(local, payload, 0o644); err != nil {
		t.Fatal(err)
	}
	scpOpts := append(append([]string{}, sshOpts...), "--local-ssh-opts=-O")
	u.run(3*time.Minute, append([]string{"scp", local, "root@vm/" + vm + ":/tmp/payload"}, scpOpts...)...)
	back := filepath.Join(dir, "back")
	u.run(3*time.Minute, append([]string{"scp", "root@vm/" + vm + ":/tmp/payload", back}, scpOpts...)...)
	if got, err := os.ReadFile(back); err != nil || !bytes.Equal(got, payload) {
		t.Errorf("scp round trip: %d bytes back (err %v), sent %d", len(got), err, len(payload))
	}
	out = u.run(3*time.Minute, append([]string{"ssh", "root@vm/" + vm, "--command", "wc -c </tmp/payload"}, sshOpts...)...)
	if !strings.Contains(out, fmt.Sprint(len(payload))) {
		t.Errorf("the guest holds %q bytes, sent %d", strings.TrimSpace(out), len(payload))
	}

	// A port nothing listens on: the tunnel fails and ssh says so.
	out = u.fail(2*time.Minute, append([]string{"ssh", "root@vm/" + vm, "-p", "2222", "--command", "true"}, sshOpts...)...)
	if !strings.Contains(out, "2222") {
		t.Errorf("ssh to a closed port said %q", out)
	}

	// The display, photographed by virtctl vnc screenshot: a PNG.
	shot := filepath.Join(dir, "shot.png")
	u.run(2*time.Minute, "vnc", "screenshot", vm, "--file="+shot)
	if f, err := os.Open(shot); err != nil {
		t.Error(err)
	} else {
		img, err := png.Decode(f)
		f.Close()
		if err != nil || img.Bounds().Dx() < 320 {
			t.Errorf("virtctl vnc screenshot wrote no display-sized PNG: %v", err)
		}
	}

	// virtctl reset: the same VMI boots again (its serial log shows a
	// second boot).
	vmi, err := n.getVMI(vm)
	if err != nil {
		t.Fatal(err)
	}
	u.run(time.Minute, "reset", vm)
	serial.expect(`NODEVIRT-GUEST-BOOTED`, bootTimeout)
	if after, err := n.getVMI(vm); err != nil || after.UID != vmi.UID || after.Status.Phase != kubevirtv1.Running {
		t.Errorf("after virtctl reset the VMI is %s (err %v), want the same running %s", vmiSummary(after), err, vmi.UID)
	}
}
