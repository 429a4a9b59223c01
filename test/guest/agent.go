package guest

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
)

// GuestAgentPort is the virtio-serial port name the guest agent opens;
// libvirt domains carry it as a channel (launcher/domain).
const GuestAgentPort = "org.qemu.guest_agent.0"

// AgentLoginTime is the login time (Unix seconds) of the root session the
// guest agent guest's utmp records on ttyS0, which guest-get-users reports.
const AgentLoginTime = 1700000000

// addGuestAgent puts Debian's qemu-ga with its libraries into the guest,
// the host's os-release (what guest-get-osinfo reads) and a utmp with one
// logged-in root session; boot.sh starts qemu-ga when it finds the port.
func addGuestAgent(ctx context.Context, a *archive) error {
	qga, err := need("/usr/sbin/qemu-ga")
	if err != nil {
		return err
	}
	if err := addHostFile(ctx, a, qga, "/usr/sbin/qemu-ga"); err != nil {
		return err
	}
	osRelease, err := filepath.EvalSymlinks("/etc/os-release")
	if err != nil {
		return fmt.Errorf("guest agent: %w", err)
	}
	a.copy("usr/lib/os-release", 0o644, osRelease)
	a.symlink("etc/os-release", "../usr/lib/os-release")
	a.symlink("var/run", "/run") // glibc's utmp is /var/run/utmp
	a.file("etc/nodevirt/utmp", 0o644, utmpRecord("root", "ttyS0", AgentLoginTime))
	return nil
}

// HostOSRelease is the os-release file a guest agent guest carries: the
// host's (a Debian one on the build machines).
func HostOSRelease() (string, error) {
	p, err := filepath.EvalSymlinks("/etc/os-release")
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile(p)
	return string(b), err
}

// utmpRecord is one glibc x86_64 utmp entry (384 bytes) of type
// USER_PROCESS.
func utmpRecord(user, line string, loginTime int32) []byte {
	const userProcess = 7
	b := make([]byte, 384)
	binary.LittleEndian.PutUint16(b[0:], userProcess)         // ut_type
	binary.LittleEndian.PutUint32(b[4:], 1)                   // ut_pid
	copy(b[8:40], line)                                       // ut_line
	copy(b[40:44], line[len(line)-min(len(line), 4):])        // ut_id
	copy(b[44:76], user)                                      // ut_user
	binary.LittleEndian.PutUint32(b[340:], uint32(loginTime)) // ut_tv.tv_sec
	return b
}
