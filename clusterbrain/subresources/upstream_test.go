package subresources

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
	"github.com/nodevirt/nodevirt/test/upstreamvirtctl"
)

// TestUpstreamVirtctlPortForward drives the brain's portforward and
// vnc/screenshot with KubeVirt's own virtctl (the pinned release) against
// the stand-in node: the wire format is upstream's. The guest end is the
// stand-in's greeting; test/e2e reaches a real guest's sshd.
func TestUpstreamVirtctlPortForward(t *testing.T) {
	setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	bin, err := upstreamvirtctl.Binary(ctx)
	if err != nil {
		t.Fatalf("upstream virtctl: %v", err)
	}
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	newVMI(t, ns, "upf", kubevirtv1.Running)
	dir := t.TempDir()
	kc := filepath.Join(dir, "kubeconfig")
	if err := cp.WriteKubeconfig(kc, "upstream-virtctl", "system:masters"); err != nil {
		t.Fatal(err)
	}
	virtctl := func(ctx context.Context, args ...string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, bin, append([]string{"--kubeconfig=" + kc, "--namespace=" + ns}, args...)...)
		cmd.Env = append(os.Environ(), "HOME="+dir, "KUBECONFIG="+kc)
		cmd.WaitDelay = 5 * time.Second
		return cmd
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	l.Close()
	pfCtx, pfCancel := context.WithCancel(ctx)
	pf := virtctl(pfCtx, "port-forward", "vmi/upf", port+":2222")
	var out bytes.Buffer
	pf.Stdout, pf.Stderr = &out, &out
	if err := pf.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { pfCancel(); pf.Wait() }()
	greeting := ""
	_ = testkit.Wait(200*time.Millisecond, time.Minute, "a greeting through the tunnel", func() (bool, error) {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+port, 5*time.Second)
		if err != nil {
			return false, err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(30 * time.Second))
		r := bufio.NewReader(c)
		greeting, _ = r.ReadString('\n')
		if greeting != "" {
			c.Write([]byte("echo-me\n"))
			if echo, _ := r.ReadString('\n'); echo != "echo-me\n" {
				t.Errorf("no echo through virtctl's tunnel: %q", echo)
			}
		}
		return greeting != "", nil
	})
	if greeting != "guest port 2222/tcp\n" {
		t.Fatalf("virtctl port-forward %s:2222 gave %q\n%s", port, greeting, out.String())
	}

	// The stdio mode ssh's ProxyCommand uses: the tunnel on stdin/stdout.
	stdio := virtctl(ctx, "port-forward", "--stdio=true", "vmi/upf/"+ns, "22")
	in, err := stdio.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := stdio.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := stdio.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 2)
	go func() {
		r := bufio.NewReader(stdout)
		for {
			l, err := r.ReadString('\n')
			if err != nil {
				close(lines)
				return
			}
			lines <- l
		}
	}()
	expectLine := func(want string) {
		t.Helper()
		select {
		case l := <-lines:
			if l != want {
				t.Fatalf("virtctl port-forward --stdio printed %q, want %q", l, want)
			}
		case <-time.After(time.Minute):
			t.Fatalf("virtctl port-forward --stdio: no %q", want)
		}
	}
	expectLine("guest port 22/tcp\n")
	if _, err := io.WriteString(in, "through-stdio\n"); err != nil {
		t.Fatal(err)
	}
	expectLine("through-stdio\n")
	in.Close()
	stdio.Process.Kill()
	stdio.Wait()

	shot := filepath.Join(dir, "shot.png")
	if b, err := virtctl(ctx, "vnc", "screenshot", "upf", "--file="+shot).CombinedOutput(); err != nil {
		t.Fatalf("virtctl vnc screenshot: %v: %s", err, b)
	}
	if b, err := os.ReadFile(shot); err != nil || !strings.HasPrefix(string(b), "\x89PNG") {
		t.Errorf("virtctl vnc screenshot wrote %q (%v)", b, err)
	}
}
