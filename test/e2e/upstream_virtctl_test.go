package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
	"github.com/nodevirt/nodevirt/test/upstreamvirtctl"
)

// The upstream client, unchanged: KubeVirt's own virtctl built from the
// release pinned in test/tools/virtctl drives nodevirt through the same
// APIs it drives KubeVirt with.

// upstream runs upstream virtctl as one user against the suite's API.
type upstream struct {
	n          *testNS
	bin        string
	kubeconfig string
}

// upstreamVirtctl builds (or finds cached) upstream virtctl and writes a
// kubeconfig for a cluster administrator.
func (n *testNS) upstreamVirtctl() *upstream {
	n.t.Helper()
	return n.upstreamVirtctlAs("e2e-upstream-virtctl", "", "system:masters")
}

// upstreamVirtctlAs is upstream virtctl for user, bound to clusterRole in
// the test's namespace when it is not empty.
func (n *testNS) upstreamVirtctlAs(user, clusterRole string, groups ...string) *upstream {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	bin, err := upstreamvirtctl.Binary(ctx)
	if err != nil {
		n.t.Fatalf("upstream virtctl: %v", err)
	}
	kc := filepath.Join(n.t.TempDir(), "kubeconfig")
	if err := n.e.cp.WriteKubeconfig(kc, user, groups...); err != nil {
		n.t.Fatal(err)
	}
	if clusterRole != "" {
		rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: user, Namespace: n.name},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: clusterRole},
			Subjects: []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: user}}}
		if _, err := n.e.kube.RbacV1().RoleBindings(n.name).Create(ctx, rb, metav1.CreateOptions{}); err != nil {
			n.t.Fatalf("bind %s to %s: %v", user, clusterRole, err)
		}
		testkit.WaitAllowed(n.t, n.e.kube, user, authorizationv1.ResourceAttributes{Namespace: n.name, Verb: "get", Group: "kubevirt.io", Resource: "virtualmachines"})
	}
	return &upstream{n: n, bin: bin, kubeconfig: kc}
}

func (u *upstream) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, u.bin, append([]string{"--kubeconfig=" + u.kubeconfig, "--namespace=" + u.n.name}, args...)...)
	// KUBECONFIG too: virtctl ssh and scp run ssh with virtctl itself as
	// the ProxyCommand, without the flag.
	cmd.Env = append(os.Environ(), "HOME="+filepath.Dir(u.kubeconfig), "KUBECONFIG="+u.kubeconfig)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// run runs one virtctl command to its end and returns its output; a
// failure or a timeout fails the test with the output.
func (u *upstream) run(timeout time.Duration, args ...string) string {
	u.n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start := time.Now()
	out, err := u.command(ctx, args...).CombinedOutput()
	if err != nil {
		u.n.t.Fatalf("virtctl %s: %v after %s\n%s", strings.Join(args, " "), err, time.Since(start).Round(time.Millisecond), out)
	}
	u.n.t.Logf("virtctl %s (%s): %s", strings.Join(args, " "), time.Since(start).Round(time.Millisecond), lastBytes(strings.TrimSpace(string(out)), 300))
	return string(out)
}

// fail runs one virtctl command that must fail and returns its output.
func (u *upstream) fail(timeout time.Duration, args ...string) string {
	u.n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := u.command(ctx, args...).CombinedOutput()
	if err == nil {
		u.n.t.Fatalf("virtctl %s succeeded, want a refusal:\n%s", strings.Join(args, " "), out)
	}
	if ctx.Err() != nil {
		u.n.t.Fatalf("virtctl %s: timed out after %s\n%s", strings.Join(args, " "), timeout, out)
	}
	return string(out)
}

// TestUpstreamVirtctlVM drives one VM through upstream virtctl: version,
// start, console, vnc, pause/unpause of the VM and of the VMI, soft-reboot,
// restart, stop, and a forced stop, checking the API objects and the
// domain after each.
func TestUpstreamVirtctlVM(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	u := n.upstreamVirtctl()
	const vm = "upstream"
	n.createVM(n.newVM(vm, kubevirtv1.RunStrategyHalted, withGracePeriod(5)))

	t.Run("version", func(t *testing.T) { u.checkVersion() })

	out := u.run(time.Minute, "start", vm)
	if !strings.Contains(out, "VM "+vm+" was scheduled to start") {
		t.Errorf("virtctl start said %q", out)
	}
	n.checkRunStrategy(vm, kubevirtv1.RunStrategyAlways)
	first := n.waitVMIOfVM(vm, 2*time.Minute)
	serial := n.waitBooted(vm)

	u.checkConsole(vm)
	u.checkVNC(vm)

	// Dry runs change nothing.
	u.run(time.Minute, "stop", vm, "--dry-run")
	n.checkRunStrategy(vm, kubevirtv1.RunStrategyAlways)
	u.run(time.Minute, "pause", "vmi", vm, "--dry-run")
	if vmi, err := n.getVMI(vm); err != nil || vmi.UID != first.UID || hasCondition(vmi, kubevirtv1.VirtualMachineInstancePaused) {
		t.Fatalf("after dry runs of stop and pause the VMI is %s (err %v), want %s running unpaused", vmiSummary(vmi), err, first.UID)
	}
	if st := domainState(n.name, vm); st != "running" {
		t.Fatalf("after a dry-run pause the domain is %q, want running", st)
	}

	out = u.run(time.Minute, "expand", "--vm", vm)
	for _, want := range []string{"kind: VirtualMachine", "name: " + vm, "memory: " + guestMemory} {
		if !strings.Contains(out, want) {
			t.Errorf("virtctl expand --vm: %q missing from\n%s", want, out)
		}
	}
	// virt-api answers 409 with a Status; this virtctl reads the body raw
	// and so reports only the code, as it does against KubeVirt.
	if out = u.fail(time.Minute, "guestosinfo", vm); !strings.Contains(out, "the server reported a conflict") {
		t.Errorf("virtctl guestosinfo of a guest without agent said %q, want a conflict", out)
	}
	viewer := n.upstreamVirtctlAs("e2e-upstream-viewer", "kubevirt.io:view")
	if out = viewer.fail(time.Minute, "pause", "vmi", vm); !strings.Contains(out, "forbidden") {
		t.Errorf("virtctl pause by a kubevirt.io:view user said %q, want forbidden", out)
	}

	for _, kind := range []string{"vmi", "vm"} {
		out = u.run(time.Minute, "pause", kind, vm)
		if !strings.Contains(out, "was scheduled to pause") {
			t.Errorf("virtctl pause %s said %q", kind, out)
		}
		n.waitVMI(vm, 30*time.Second, "paused by virtctl pause "+kind, pausedState(n, vm, true))
		out = u.run(time.Minute, "unpause", kind, vm)
		if !strings.Contains(out, "was scheduled to unpause") {
			t.Errorf("virtctl unpause %s said %q", kind, out)
		}
		n.waitVMI(vm, 30*time.Second, "unpaused by virtctl unpause "+kind, pausedState(n, vm, false))
	}

	// A soft reboot goes through the guest (ACPI): it powers off and boots
	// again inside the same VMI.
	out = u.run(time.Minute, "soft-reboot", vm)
	if !strings.Contains(out, "was scheduled to soft-reboot") {
		t.Errorf("virtctl soft-reboot said %q", out)
	}
	serial.expect(`NODEVIRT-GUEST-POWEROFF`, 60*time.Second)
	serial.expect(`NODEVIRT-GUEST-READY`, bootTimeout)
	if vmi, err := n.getVMI(vm); err != nil || vmi.UID != first.UID || vmi.Status.Phase != kubevirtv1.Running {
		t.Fatalf("after soft-reboot the VMI is %v (err %v), want the same running VMI %s", vmiSummary(vmi), err, first.UID)
	}

	u.run(time.Minute, "restart", vm)
	second := n.waitVMIOfVM(vm, 2*time.Minute, first.UID)
	n.checkRunStrategy(vm, kubevirtv1.RunStrategyAlways)

	out = u.run(time.Minute, "stop", vm)
	if !strings.Contains(out, "VM "+vm+" was scheduled to stop") {
		t.Errorf("virtctl stop said %q", out)
	}
	n.checkRunStrategy(vm, kubevirtv1.RunStrategyHalted)
	n.waitGone(vm, 90*time.Second)
	n.waitPrintableStatus(vm, kubevirtv1.VirtualMachineStatusStopped)

	// A forced stop takes the VMI down without its grace period.
	u.run(time.Minute, "start", vm)
	third := n.waitVMIOfVM(vm, 2*time.Minute, first.UID, second.UID)
	start := time.Now()
	u.run(time.Minute, "stop", vm, "--force", "--grace-period=0")
	n.checkRunStrategy(vm, kubevirtv1.RunStrategyHalted)
	n.waitGone(vm, 60*time.Second)
	if took := time.Since(start); took > 30*time.Second {
		t.Errorf("a forced stop of VMI %s took %s", third.UID, took.Round(time.Second))
	}
	n.waitPrintableStatus(vm, kubevirtv1.VirtualMachineStatusStopped)
}

// checkVersion: virtctl version reports its own release and the server's
// version document.
func (u *upstream) checkVersion() {
	n := u.n
	n.t.Helper()
	raw, err := n.e.kube.Discovery().RESTClient().Get().AbsPath("/apis", subresourcesGV, "version").DoRaw(context.Background())
	if err != nil {
		n.t.Fatalf("GET %s/version: %v", subresourcesGV, err)
	}
	var server struct {
		GitVersion string `json:"gitVersion"`
	}
	if err := json.Unmarshal(raw, &server); err != nil || server.GitVersion == "" {
		n.t.Fatalf("%s/version answered %s (%v)", subresourcesGV, raw, err)
	}
	out := u.run(time.Minute, "version")
	root, _ := filepath.Abs(filepath.Join(n.e.repo, "test/tools/virtctl"))
	client, err := upstreamvirtctl.PinnedVersion(root)
	if err != nil {
		n.t.Fatal(err)
	}
	for _, want := range []string{`Client Version: version.Info{GitVersion:"` + client + `"`,
		`Server Version: version.Info{GitVersion:"` + server.GitVersion + `"`} {
		if !strings.Contains(out, want) {
			n.t.Errorf("virtctl version: %q missing from\n%s", want, out)
		}
	}
}

// upstreamConsole is a running virtctl console on a pseudo-terminal.
type upstreamConsole struct {
	u      *upstream
	cmd    *exec.Cmd
	ptm    *os.File
	term   *ptyReader
	done   chan error
	cancel context.CancelFunc
}

// openConsole starts virtctl console on a pseudo-terminal and waits until
// it says it is connected.
func (u *upstream) openConsole(vm string) *upstreamConsole {
	n := u.n
	n.t.Helper()
	ptm, pts, err := openPTY()
	if err != nil {
		n.t.Fatalf("pty: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	cmd := u.command(ctx, "console", vm, "--timeout=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = pts, pts, pts
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true}
	err = cmd.Start()
	pts.Close()
	if err != nil {
		cancel()
		ptm.Close()
		n.t.Fatal(err)
	}
	c := &upstreamConsole{u: u, cmd: cmd, ptm: ptm, term: &ptyReader{f: ptm, changed: make(chan struct{}, 1)},
		done: make(chan error, 1), cancel: cancel}
	go func() { c.done <- cmd.Wait() }()
	go c.term.read()
	n.t.Cleanup(c.close)
	c.term.expect(n.t, `Successfully connected to `+vm+` console`, 30*time.Second)
	return c
}

// shell presses Enter until the guest's shell prompt answers, then types a
// command and reads its output.
func (c *upstreamConsole) shell(word string) {
	t := c.u.n.t
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !c.term.seen(`nodevirt# `) {
		if time.Now().After(deadline) {
			c.term.expect(t, `nodevirt# `, 0)
		}
		_, _ = c.ptm.Write([]byte("\r"))
		c.term.wait(2 * time.Second)
	}
	c.term.skip()
	_, _ = c.ptm.Write([]byte("echo " + word + "-$((6 * 7))\r"))
	c.term.expect(t, `(?m)^`+word+`-42\r?$`, 20*time.Second)
}

// exited waits for virtctl console to end and returns its error.
func (c *upstreamConsole) exited(timeout time.Duration) (ended bool, err error) {
	select {
	case err := <-c.done:
		c.done <- err
		return true, err
	case <-time.After(timeout):
		return false, nil
	}
}

func (c *upstreamConsole) close() {
	c.cancel()
	<-c.done
	c.ptm.Close()
}

// checkConsole types a command into the guest through virtctl console on a
// pseudo-terminal and reads its answer; a second virtctl console takes the
// console over (the first one is disconnected), and Ctrl+] leaves it.
func (u *upstream) checkConsole(vm string) {
	t := u.n.t
	t.Helper()
	first := u.openConsole(vm)
	first.shell("upstream")
	second := u.openConsole(vm)
	if ended, _ := first.exited(15 * time.Second); !ended {
		t.Errorf("the first virtctl console still runs 15 s after a second one connected")
	} else if !first.term.seen(`disconnected from the console`) {
		t.Logf("the first virtctl console ended without the disconnection notice:\n%s", first.term.all())
	}
	second.shell("second")
	_, _ = second.ptm.Write([]byte{0x1d}) // Ctrl+]
	ended, err := second.exited(15 * time.Second)
	switch {
	case !ended:
		t.Errorf("virtctl console still runs 15 s after Ctrl+]")
	case err != nil:
		t.Errorf("virtctl console did not end cleanly on Ctrl+]: %v\n%s", err, second.term.all())
	}
}

// checkVNC starts virtctl vnc --proxy-only, connects to the port it prints
// and reads the guest's RFB greeting.
func (u *upstream) checkVNC(vm string) {
	n := u.n
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := u.command(ctx, "vnc", vm, "--proxy-only")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		n.t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		n.t.Fatal(err)
	}
	defer func() {
		cancel()
		_ = cmd.Wait()
	}()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		n.t.Fatalf("virtctl vnc --proxy-only printed no port: %v\n%s", err, stderr.String())
	}
	var printed struct {
		Port int `json:"port"`
	}
	if err := json.Unmarshal([]byte(line), &printed); err != nil || printed.Port == 0 {
		n.t.Fatalf("virtctl vnc --proxy-only printed %q, want {\"port\":N}: %v", line, err)
	}
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", printed.Port), 10*time.Second)
	if err != nil {
		n.t.Fatalf("connect to the vnc proxy: %v\n%s", err, stderr.String())
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	greeting := make([]byte, 12)
	if _, err := io.ReadFull(conn, greeting); err != nil {
		n.t.Fatalf("read the RFB greeting through virtctl vnc: %v\n%s", err, stderr.String())
	}
	if !regexp.MustCompile(`^RFB \d{3}\.\d{3}\n$`).Match(greeting) {
		n.t.Fatalf("virtctl vnc relayed %q, want an RFB protocol version", greeting)
	}
}

// TestUpstreamVirtctlImageUpload: virtctl image-upload dv creates an upload
// DataVolume, waits for it, gets a token from upload.cdi.kubevirt.io and
// streams the image through the brain's upload proxy; the volume then holds
// the image byte for byte.
func TestUpstreamVirtctlImageUpload(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	u := n.upstreamVirtctl()
	proxy := e.uploadProxyURL(t)

	const size = 4 << 20
	image := make([]byte, size)
	rng := rand.NewChaCha8([32]byte{'n', 'o', 'd', 'e', 'v', 'i', 'r', 't'})
	_, _ = rng.Read(image[512:]) // a first sector of zeros: no format's magic
	path := filepath.Join(t.TempDir(), "upload.raw")
	if err := os.WriteFile(path, image, 0o644); err != nil {
		t.Fatal(err)
	}
	out := u.run(3*time.Minute, "image-upload", "dv", "uploaded", "--size=64Mi", "--storage-class=hostpath-csi",
		"--image-path="+path, "--insecure", "--uploadproxy-url="+proxy)
	for _, want := range []string{"DataVolume " + n.name + "/uploaded created", "Uploading data to " + proxy,
		"Uploading " + path + " completed successfully"} {
		if !strings.Contains(out, want) {
			t.Errorf("virtctl image-upload: %q missing from its output", want)
		}
	}
	n.checkUploaded("uploaded", image)

	// A bare claim: virtctl makes the PVC with CDI's upload-target
	// annotation and waits for its pod.ready annotation.
	u.run(3*time.Minute, "image-upload", "pvc", "bare-claim", "--size=64Mi", "--storage-class=hostpath-csi",
		"--image-path="+path, "--insecure", "--uploadproxy-url="+proxy)
	n.checkUploaded("bare-claim", image)

	// Without --uploadproxy-url virtctl reads CDIConfig "config", where the
	// brain records its proxy when the CDIConfig API is served.
	if list, err := e.kube.Discovery().ServerResourcesForGroupVersion("cdi.kubevirt.io/v1beta1"); err != nil ||
		!slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == "cdiconfigs" }) {
		t.Logf("cdiconfigs are not served: image-upload without --uploadproxy-url not checked")
		return
	}
	u.run(3*time.Minute, "image-upload", "dv", "found-proxy", "--size=64Mi", "--storage-class=hostpath-csi",
		"--image-path="+path, "--insecure")
	n.checkUploaded("found-proxy", image)
}

// checkUploaded checks that the upload succeeded (and its DataVolume, when
// one owns the claim) and that the volume holds image byte for byte (then
// zeros up to its size).
func (n *testNS) checkUploaded(name string, image []byte) {
	t, e := n.t, n.e
	t.Helper()
	size := len(image)
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pvc.Annotations["cdi.kubevirt.io/storage.pod.phase"]; got != string(corev1.PodSucceeded) {
		t.Errorf("pvc annotation cdi.kubevirt.io/storage.pod.phase = %q, want Succeeded", got)
	}
	if metav1.GetControllerOf(pvc) != nil {
		n.waitDataVolumeSucceeded(name)
	}
	pv, err := e.kube.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil || pv.Spec.CSI == nil {
		t.Fatalf("pv %q of the uploaded claim: %v", pvc.Spec.VolumeName, err)
	}
	disk := e.path("pools", poolName(), "volumes", pv.Spec.CSI.VolumeHandle, "disk.img")
	got, err := os.ReadFile(disk)
	if err != nil {
		t.Fatalf("the uploaded volume's disk: %v", err)
	}
	if len(got) < size || !bytes.Equal(got[:size], image) {
		t.Fatalf("%s (%d bytes) does not start with the %d uploaded bytes", disk, len(got), size)
	}
	if tail := got[size:]; len(bytes.Trim(tail, "\x00")) != 0 {
		t.Errorf("%s has data after the uploaded image (%d bytes, not all zero)", disk, len(tail))
	}
}

// waitDataVolumeSucceeded waits for the DataVolume name to succeed.
func (n *testNS) waitDataVolumeSucceeded(name string) {
	n.eventually(30*time.Second, "datavolume "+name+" Succeeded", func() (bool, string) {
		dv, err := n.e.virt.DataVolumes.Get(context.Background(), n.name, name)
		if err != nil {
			return false, err.Error()
		}
		return dv.Status.Phase == "Succeeded", fmt.Sprintf("phase %q", dv.Status.Phase)
	})
}

var uploadProxyRE = regexp.MustCompile(`role=upload\b.*\bproxy=(\S+)`)

// uploadProxyURL is the brain's upload proxy as a user outside the cluster
// reaches it (the brain took a kernel-picked port and logs it).
func (e *env) uploadProxyURL(t *testing.T) string {
	t.Helper()
	var port string
	testkit.PollEvery(t, 500*time.Millisecond, 30*time.Second, "the brain's log to name the upload proxy address (role=upload ... proxy=)", func() (bool, error) {
		data, _ := os.ReadFile(e.brain.logPath)
		m := uploadProxyRE.FindAllStringSubmatch(string(data), -1)
		if m == nil {
			return false, nil
		}
		var err error
		if _, port, err = net.SplitHostPort(strings.Trim(m[len(m)-1][1], `"`)); err != nil {
			t.Fatalf("upload proxy address %q in the brain's log: %v", m[len(m)-1][1], err)
		}
		return true, nil
	})
	return "https://127.0.0.1:" + port
}

func (n *testNS) checkRunStrategy(vm string, want kubevirtv1.VirtualMachineRunStrategy) {
	n.t.Helper()
	got, err := n.getVM(vm)
	if err != nil {
		n.t.Fatal(err)
	}
	if rs, _ := got.RunStrategy(); rs != want {
		n.t.Fatalf("vm %s runStrategy %s, want %s", vm, rs, want)
	}
}

func (n *testNS) waitPrintableStatus(vm string, want kubevirtv1.VirtualMachinePrintableStatus) {
	n.t.Helper()
	n.eventually(30*time.Second, fmt.Sprintf("vm %s printableStatus %s", vm, want), func() (bool, string) {
		got, err := n.getVM(vm)
		if err != nil {
			return false, err.Error()
		}
		return got.Status.PrintableStatus == want, n.diagnoseVM(vm, nil)
	})
}

func vmiSummary(vmi *kubevirtv1.VirtualMachineInstance) string {
	if vmi == nil {
		return "<none>"
	}
	return fmt.Sprintf("uid %s phase %s", vmi.UID, vmi.Status.Phase)
}

// openPTY opens a pseudo-terminal pair: the controlling side and the
// terminal a child gets as its stdin/stdout.
func openPTY() (ptm, pts *os.File, err error) {
	ptm, err = os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	fd := int(ptm.Fd())
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		ptm.Close()
		return nil, nil, fmt.Errorf("unlock pty: %w", err)
	}
	num, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		ptm.Close()
		return nil, nil, fmt.Errorf("pty number: %w", err)
	}
	pts, err = os.OpenFile(fmt.Sprintf("/dev/pts/%d", num), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		ptm.Close()
		return nil, nil, err
	}
	return ptm, pts, nil
}

// ptyReader collects what a child writes on its terminal.
type ptyReader struct {
	f       *os.File
	mu      sync.Mutex
	out     []byte
	cursor  int
	err     error
	changed chan struct{}
}

func (p *ptyReader) read() {
	buf := make([]byte, 4096)
	for {
		n, err := p.f.Read(buf)
		p.mu.Lock()
		p.out = append(p.out, buf[:n]...)
		p.err = err
		p.mu.Unlock()
		select {
		case p.changed <- struct{}{}:
		default:
		}
		if err != nil {
			return
		}
	}
}

func (p *ptyReader) wait(d time.Duration) {
	select {
	case <-p.changed:
	case <-time.After(d):
	}
}

func (p *ptyReader) seen(pattern string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return regexp.MustCompile(pattern).Match(p.out[p.cursor:])
}

// skip moves the cursor past everything read so far, after letting
// pending echoes arrive.
func (p *ptyReader) skip() {
	time.Sleep(300 * time.Millisecond)
	p.mu.Lock()
	p.cursor = len(p.out)
	p.mu.Unlock()
}

func (p *ptyReader) all() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return lastBytes(string(p.out), 800)
}

// expect waits until the output after the cursor matches pattern and moves
// the cursor past the match.
func (p *ptyReader) expect(t *testing.T, pattern string, timeout time.Duration) {
	t.Helper()
	re := regexp.MustCompile(pattern)
	deadline := time.Now().Add(timeout)
	for {
		p.mu.Lock()
		rest := p.out[p.cursor:]
		if m := re.FindIndex(rest); m != nil {
			p.cursor += m[1]
			p.mu.Unlock()
			return
		}
		readErr := p.err
		p.mu.Unlock()
		if time.Now().After(deadline) || readErr != nil {
			t.Fatalf("virtctl console: %q not seen after %s (read error %v); terminal output:\n%s", pattern, timeout, readErr, lastBytes(string(rest), 600))
		}
		p.wait(250 * time.Millisecond)
	}
}
