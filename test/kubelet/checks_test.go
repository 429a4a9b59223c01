package kubelet

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/nodeagent/bridgemarker"
	"github.com/nodevirt/nodevirt/test/guest"
)

const (
	nodevirtNS  = "kubevirt-hyperconverged"
	vmNamespace = "kubelet-test-vm"
	// domain is the libvirt domain of VM vm in vmNamespace.
	domain = vmNamespace + "_vm"
)

// qemuPid is the pid of the domain's QEMU, from the pid file libvirtd
// keeps for it.
func qemuPid(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/run/libvirt/qemu/" + domain + ".pid")
	if err != nil {
		t.Fatalf("QEMU of %s: %v", domain, err)
	}
	return strings.TrimSpace(string(b))
}

// consoleAnswers opens a console session to the VM with the build's own
// virtctl (the linux/amd64 download the virtctl image carries) through the
// API server (subresources.kubevirt.io, served by the brain, proxied to the
// node agent), waits for the guest's shell and checks it computes an
// answer typed on the console.
func consoleAnswers(t *testing.T, virtctl, kubeconfig, word string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, virtctl, "--kubeconfig="+kubeconfig, "-n", vmNamespace, "console", "vm", "--timeout=3")
	cmd.WaitDelay = 5 * time.Second
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("virtctl console: %v", err)
	}
	ended := false
	defer func() {
		if !ended {
			cancel()
			_ = cmd.Wait()
			t.Logf("virtctl console stderr: %s", stderr.String())
		}
	}()
	con := guest.ReadConsole(stdout)
	con.Login(t, stdin, 3*time.Minute)
	if _, err := io.WriteString(stdin, "echo "+word+"-$((6 * 7))\n"); err != nil {
		t.Fatalf("console: %v", err)
	}
	con.ExpectExact(t, word+"-42", time.Minute)
	// The end of input leaves the console, as Ctrl+] does.
	stdin.Close()
	ended = true
	if err := cmd.Wait(); err != nil {
		t.Errorf("virtctl console after the end of its input: %v\n%s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "Successfully connected to vm console") {
		t.Errorf("virtctl console did not report its connection: %q", stderr.String())
	}
}

// advertisesBridges adds a bridge to the host and waits for the node agent
// (its bridge marker) to advertise it on the Node as
// bridge.network.kubevirt.io/<bridge>; the bridge goes at the end.
func advertisesBridges(t *testing.T, ctx context.Context, kube kubernetes.Interface, node string) {
	t.Helper()
	const br = "nvkt-mark"
	if out, err := exec.Command("ip", "link", "add", br, "type", "bridge").CombinedOutput(); err != nil {
		t.Fatalf("add bridge %s: %v: %s", br, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "link", "del", br).CombinedOutput(); err != nil {
			t.Errorf("delete bridge %s: %v: %s", br, err, out)
		}
	})
	wait(t, ctx, 2*time.Minute, "Node advertises "+bridgemarker.ResourcePrefix+br, func() error {
		n, err := kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		q, ok := n.Status.Allocatable[bridgemarker.ResourcePrefix+br]
		if !ok || q.Value() < 1 {
			return errors.New("not in allocatable")
		}
		return nil
	})
}
