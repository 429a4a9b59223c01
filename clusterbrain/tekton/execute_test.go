package tekton

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// sshServer runs Dropbear on a free loopback port in a mount namespace
// whose /root holds only authorizedKey; it returns the port and the host
// public key ("ssh-ed25519 AAAA…").
func sshServer(t *testing.T, authorizedKey string) (int, string) {
	t.Helper()
	if _, err := exec.LookPath("dropbear"); err != nil {
		t.Fatal("dropbear (Debian dropbear-bin, make deps) is needed: ", err)
	}
	dir := t.TempDir()
	hostKey := filepath.Join(dir, "host_ed25519")
	if out, err := exec.Command("dropbearkey", "-t", "ed25519", "-f", hostKey).CombinedOutput(); err != nil {
		t.Fatalf("dropbearkey: %v %s", err, out)
	}
	pub, err := exec.Command("dropbearkey", "-y", "-f", hostKey).Output()
	if err != nil {
		t.Fatal(err)
	}
	var hostPub string
	for _, l := range strings.Split(string(pub), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && strings.HasPrefix(f[0], "ssh-") {
			hostPub = f[0] + " " + f[1]
		}
	}
	keys := filepath.Join(dir, "authorized_keys")
	if err := os.WriteFile(keys, []byte(authorizedKey), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	script := fmt.Sprintf(`mount -t tmpfs -o mode=0700 none /root && mkdir -m 0700 /root/.ssh && cp %s /root/.ssh/authorized_keys &&
exec dropbear -F -E -s -p 127.0.0.1:%d -r %s -P %s/pid`, keys, port, hostKey, dir)
	cmd := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c", script)
	logf, _ := os.Create(filepath.Join(dir, "log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait(); logf.Close() })
	if err := testkit.Wait(100*time.Millisecond, 30*time.Second, "dropbear to listen", func() (bool, error) {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
		}
		return err == nil, err
	}); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "log"))
		t.Fatalf("%v\n%s", err, log)
	}
	return port, hostPub
}

func TestExecuteInVM(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	// The connection Secret comes from generate-ssh-keys, as in upstream's
	// pipelines; the server trusts its public key.
	e.run(t, 0, "generate-ssh-keys", "--privateKeySecretName=conn", "--publicKeySecretName=pub")
	pub, err := e.c.Kube.CoreV1().Secrets(e.ns).Get(ctx, "pub", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	port, hostPub := sshServer(t, string(pub.Data[PublicKeyKey]))
	conn, err := e.c.Kube.CoreV1().Secrets(e.ns).Get(ctx, "conn", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	conn.Data[SecretUser] = []byte("root")
	conn.Data[SecretHostPublicKey] = []byte(hostPub)
	conn.Data[SecretSSHOptions] = []byte(fmt.Sprintf("-p %d -o ConnectTimeout=20", port))
	if _, err := e.c.Kube.CoreV1().Secrets(e.ns).Update(ctx, conn, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The VMI runs and reports its pod network address (the server's).
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "guest", Namespace: e.ns},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{Networks: []kubevirtv1.Network{*kubevirtv1.DefaultPodNetwork()}}}
	got, err := e.c.Virt.VMIs.Create(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	got.Status.Phase = kubevirtv1.Running
	got.Status.Interfaces = []kubevirtv1.VirtualMachineInstanceNetworkInterface{{Name: "default", IP: "127.0.0.1"}}
	if _, err := e.c.Virt.VMIs.UpdateStatus(ctx, got); err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	mark := filepath.Join(dir, "from-script")
	e.run(t, 0, "execute-in-vm", "--vmName=guest", "--secretName=conn", "--secretDir=", "--timeout=2m",
		"--script=echo \"$(id -u) ran\" > "+mark)
	if data, err := os.ReadFile(mark); err != nil || string(data) != "0 ran\n" {
		t.Errorf("the script's mark: %q %v", data, err)
	}
	spaced := filepath.Join(dir, "a file with spaces")
	e.run(t, 0, "execute-in-vm", "--vmName=guest", "--secretName=conn", "--secretDir=", "--timeout=2m", "--",
		"--array-param=command", "touch", "--array-param=args", spaced)
	if _, err := os.Stat(spaced); err != nil {
		t.Errorf("command and args: %v", err)
	}
	if out := e.run(t, 1, "execute-in-vm", "--vmName=guest", "--secretName=conn", "--secretDir=", "--timeout=2m", "--script=exit 3"); !strings.Contains(out, "exited 3") {
		t.Errorf("a failing script: %s", out)
	}
	// A host key that is not the server's is refused (strict checking).
	if conn, err = e.c.Kube.CoreV1().Secrets(e.ns).Get(ctx, "conn", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	conn.Data[SecretHostPublicKey] = pub.Data[PublicKeyKey]
	if _, err := e.c.Kube.CoreV1().Secrets(e.ns).Update(ctx, conn, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(mark + "2"); err == nil {
		t.Fatal("stale mark")
	}
	e.run(t, 1, "execute-in-vm", "--vmName=guest", "--secretName=conn", "--secretDir=", "--timeout=2m", "--script=touch "+mark+"2")
	if _, err := os.Stat(mark + "2"); err == nil {
		t.Error("the command ran on a server whose host key was not the one given")
	}
	if out := e.run(t, 1, "execute-in-vm", "--vmName=guest", "--script=true"); !strings.Contains(out, "secretName") {
		t.Errorf("no secret: %s", out)
	}
}
