package guest

import (
	"bufio"
	"encoding/json"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// agentCall sends one guest agent command over the agent socket and
// decodes its "return" value.
func agentCall(t *testing.T, conn net.Conn, r *bufio.Reader, command string, out any) {
	t.Helper()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := conn.Write([]byte(`{"execute":"` + command + `"}` + "\n")); err != nil {
		t.Fatal(err)
	}
	line, err := r.ReadBytes('\n')
	if err != nil {
		t.Fatalf("%s: %v", command, err)
	}
	var reply struct {
		Return json.RawMessage `json:"return"`
		Error  json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(line, &reply); err != nil || reply.Error != nil {
		t.Fatalf("%s: %q: %v", command, line, err)
	}
	if err := json.Unmarshal(reply.Return, out); err != nil {
		t.Fatalf("%s: %q: %v", command, line, err)
	}
}

// TestGuestAgentUnderQEMU boots a guest with Spec.GuestAgent and a
// virtio-serial port named GuestAgentPort on a unix socket, and talks to
// its qemu-ga: the OS is the host's os-release, the user is utmp's root.
func TestGuestAgentUnderQEMU(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	vmlinuz, _, err := Kernel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	initrd, err := Initramfs(ctx, Spec{GuestAgent: true})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "qga.sock")
	in, err := Run(ctx, RunSpec{Kernel: vmlinuz, Initramfs: initrd, Log: t.Output(), ExtraArgs: []string{
		"-chardev", "socket,id=qga,path=" + sock + ",server=on,wait=off",
		"-device", "virtio-serial-pci", "-device", "virtserialport,chardev=qga,name=" + GuestAgentPort,
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Kill()
	if line := expect(t, ctx, in, "NODEVIRT-AGENT-STARTED"); !strings.HasSuffix(line, "/dev/virtio-ports/"+GuestAgentPort) {
		t.Fatalf("agent line %q", line)
	}
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r := bufio.NewReader(conn)
	// guest-ping answers {} once qemu-ga reads the port; before that the
	// bytes wait in the port.
	var empty struct{}
	agentCall(t, conn, r, "guest-ping", &empty)

	var osinfo struct {
		ID            string `json:"id"`
		KernelRelease string `json:"kernel-release"`
	}
	agentCall(t, conn, r, "guest-get-osinfo", &osinfo)
	release, err := HostOSRelease()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(release, "ID="+osinfo.ID+"\n") || osinfo.KernelRelease == "" {
		t.Errorf("osinfo %+v does not match the host's os-release:\n%s", osinfo, release)
	}
	var users []struct {
		User      string  `json:"user"`
		LoginTime float64 `json:"login-time"`
	}
	agentCall(t, conn, r, "guest-get-users", &users)
	if len(users) != 1 || users[0].User != "root" || int64(users[0].LoginTime) != AgentLoginTime {
		t.Errorf("users %+v, want root since %d", users, AgentLoginTime)
	}
}
