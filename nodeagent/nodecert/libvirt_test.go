package nodecert_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
	"github.com/nodevirt/nodevirt/nodeagent/nodecert"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestLibvirtTLSWithNodeCertificates gets a node certificate from the
// brain's signer written in libvirt's layout, starts a libvirtd of its own
// (in a mount namespace, beside any other) listening with TLS on those
// files, and connects to it as a migrating source's libvirtd does
// (qemu+tls://<address>/system?pkipath=DIR): admitted with the node's own
// certificate, refused with a certificate of another CA and with one of the
// node CA that is not a node's (libvirttls's tls_allowed_dn_list), and the
// server refused by a client trusting another CA. A renewed certificate is
// served after virt-admin server-update-tls, without a restart.
func TestLibvirtTLSWithNodeCertificates(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("a privileged libvirtd needs root")
	}
	for _, bin := range []string{"libvirtd", "virsh", "unshare"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("%s: %v", bin, err)
		}
	}
	brain(t)
	const node, addr = "cert-node-tls", "127.0.0.1"
	admin := controlplane.Shared(t).Clientset(t)
	ctx := context.Background()
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: addr}}
	if _, err := admin.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pki := filepath.Join(t.TempDir(), "libvirt-pki")
	certDir := t.TempDir()
	src, err := nodecert.New(nodecert.Config{Kube: nodeClient(t, node), NodeName: node, Dir: certDir,
		IPs: []net.IP{net.ParseIP(addr)}, LibvirtDir: pki, Wait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Request(ctx); err != nil {
		t.Fatal(err)
	}
	// A restarted agent reuses the stored certificate only while it
	// carries the addresses asked for.
	for ip, reused := range map[string]bool{addr: true, "127.0.0.9": false} {
		again, err := nodecert.New(nodecert.Config{Kube: nodeClient(t, node), NodeName: node, Dir: certDir, IPs: []net.IP{net.ParseIP(ip)}})
		if err != nil {
			t.Fatal(err)
		}
		if again.Ready() != reused {
			t.Errorf("stored certificate with address %s asked for: reused %t", ip, again.Ready())
		}
	}
	port := freePort(t)
	agent := startTLSLibvirtd(t, pki, addr, port)
	uri := func(dir string) string {
		return fmt.Sprintf("qemu+tls://%s:%d/system?pkipath=%s", addr, port, dir)
	}

	// The node's own certificate: admitted.
	var out []byte
	err = testkit.Wait(time.Second, 60*time.Second, "virsh to connect", func() (bool, error) {
		var err error
		out, err = exec.Command("virsh", "-c", uri(pki), "uri").CombinedOutput()
		return err == nil, err
	})
	if err != nil {
		t.Fatalf("connect with the node certificate: %v: %s", err, out)
	}

	// A client certificate of another CA, with the same name: refused by
	// the server. The client trusts both CAs, else libvirt's client would
	// refuse its own certificate before connecting.
	other, err := certs.CreateCA("not-the-node-ca", time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	foreign := filepath.Join(t.TempDir(), "foreign")
	kp, err := other.Issue(certs.Leaf{CommonName: identity.NodeUser(node), Organization: []string{identity.NodesGroup},
		DNSNames: []string{node}, IPs: []net.IP{net.ParseIP(addr)}, Server: true, Client: true})
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(filepath.Join(pki, nodecert.LibvirtCAFile))
	if err != nil {
		t.Fatal(err)
	}
	writePKI(t, foreign, append(append([]byte{}, caPEM...), other.CertPEM...), kp.CertPEM, kp.KeyPEM)
	if out, err := exec.Command("virsh", "-c", uri(foreign), "uri").CombinedOutput(); err == nil || strings.Contains(string(out), "Our own certificate") {
		t.Errorf("a client certificate of another CA: %v: %s, want it refused by the server", err, out)
	}

	// A certificate of the node CA, but not a node's (the brain's
	// identity): refused by libvirtd's tls_allowed_dn_list.
	nodeCA, err := uploadtls.LoadCA(ctx, admin, brain(t))
	if err != nil {
		t.Fatal(err)
	}
	notNode, err := nodeCA.Authority().Issue(certs.Leaf{CommonName: "nodevirt:clusterbrain", Organization: []string{"nodevirt:clusterbrains"},
		DNSNames: []string{node}, IPs: []net.IP{net.ParseIP(addr)}, Server: true, Client: true})
	if err != nil {
		t.Fatal(err)
	}
	other2 := filepath.Join(t.TempDir(), "not-a-node")
	writePKI(t, other2, caPEM, notNode.CertPEM, notNode.KeyPEM)
	if out, err := exec.Command("virsh", "-c", uri(other2), "uri").CombinedOutput(); err == nil || strings.Contains(string(out), "Our own certificate") {
		t.Errorf("a node CA certificate that is not a node's: %v: %s, want it refused by the server", err, out)
	}

	// A node of another CA (its certificate and trust both of that CA)
	// refuses the node CA's server.
	distrust := filepath.Join(t.TempDir(), "distrust")
	writePKI(t, distrust, other.CertPEM, kp.CertPEM, kp.KeyPEM)
	if out, err := exec.Command("virsh", "-c", uri(distrust), "uri").CombinedOutput(); err == nil || !strings.Contains(string(out), "verify peer's certificate") {
		t.Errorf("a client trusting another CA: %v: %s, want the server's certificate refused", err, out)
	}

	// The server's name is checked: the same listener reached by the name
	// "localhost", which the certificate does not carry, is refused.
	byName := fmt.Sprintf("qemu+tls://localhost:%d/system?pkipath=%s", port, pki)
	if out, err := exec.Command("virsh", "-c", byName, "uri").CombinedOutput(); err == nil || !strings.Contains(string(out), "does not match the hostname") {
		t.Errorf("a server reached by a name its certificate lacks: %v: %s, want refused", err, out)
	}

	// The files libvirt reads: the node CA alone as trust, the leaf as
	// client and server certificate.
	crt, err := os.ReadFile(filepath.Join(pki, nodecert.LibvirtClientCertFile))
	if err != nil {
		t.Fatal(err)
	}
	leafs, err := certs.ParseCertificates(crt)
	if err != nil || len(leafs) != 1 || leafs[0].SerialNumber.Cmp(src.Leaf().SerialNumber) != 0 {
		t.Errorf("client certificate file: %d certificates, %v", len(leafs), err)
	}
	cas, err := certs.ParseCertificates(caPEM)
	if err != nil || len(cas) != 1 || !cas[0].IsCA {
		t.Fatalf("ca file: %v", err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(cas[0])
	if _, err := src.Leaf().Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("leaf against the written ca: %v", err)
	}

	// Renewed: the running libvirtd serves the new certificate once told
	// (server-update-tls through its admin socket), the old one before.
	old := src.Leaf().SerialNumber.String()
	if got := servedSerial(t, src, addr, port); got != old {
		t.Fatalf("libvirtd serves certificate %s, the node's is %s", got, old)
	}
	if err := src.Request(ctx); err != nil {
		t.Fatal(err)
	}
	renewed := src.Leaf().SerialNumber.String()
	if got := servedSerial(t, src, addr, port); got != old {
		t.Fatalf("libvirtd serves %s before the update, want still %s", got, old)
	}
	// What the agent does after each certificate: its blocks unchanged,
	// the server files copied and server-update-tls.
	if err := agent.Apply(ctx); err != nil {
		t.Fatal(err)
	}
	if got := servedSerial(t, src, addr, port); got != renewed {
		t.Errorf("libvirtd serves %s after server-update-tls, want the renewed %s (was %s)", got, renewed, old)
	}
	if out, err := exec.Command("virsh", "-c", uri(pki), "uri").CombinedOutput(); err != nil {
		t.Errorf("connect with the renewed certificate: %v: %s", err, out)
	}
}

// servedSerial is the serial of the certificate the TLS listener at addr
// presents to the node's own client certificate.
func servedSerial(t *testing.T, src *nodecert.Source, addr string, port int) string {
	t.Helper()
	cfg, err := src.PeerTLS(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ServerName = addr
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 30 * time.Second}, "tcp", net.JoinHostPort(addr, strconv.Itoa(port)), cfg)
	if err != nil {
		t.Fatalf("tls to libvirtd: %v", err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
}

func writePKI(t *testing.T, dir string, ca, cert, key []byte) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{nodecert.LibvirtCAFile: ca, nodecert.LibvirtClientCertFile: cert, nodecert.LibvirtClientKeyFile: key} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startTLSLibvirtd runs a libvirtd of its own, in a mount namespace where
// libvirt's directories are empty ones of the test, listening with TLS on
// addr:port, configured as the node agent configures its node's (package
// libvirttls: the blocks in libvirtd.conf and qemu.conf, the server files
// of pki copied to /etc/pki, here a directory of the test bound there); it
// is killed at cleanup. It returns the agent's configurer for this
// libvirtd.
func startTLSLibvirtd(t *testing.T, pki, addr string, port int) *libvirttls.Configurer {
	t.Helper()
	d := t.TempDir()
	for _, sub := range []string{"etc", "run", "lib", "cache", "log", "qemu-tls", "pki/CA", "pki/libvirt"} {
		if err := os.MkdirAll(filepath.Join(d, sub), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Mount points only; the host's own files there are never touched.
	for _, dir := range []string{"/etc/pki/CA", "/etc/pki/libvirt"} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	conf := filepath.Join(d, "etc", "libvirtd.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf("listen_tls = 1\nlisten_tcp = 0\nlisten_addr = %q\ntls_port = \"%d\"\n", addr, port)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "etc", "qemu.conf"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	agent := libvirttls.New(libvirttls.Config{ConfDir: filepath.Join(d, "etc"), PKIDir: pki, QEMUDir: filepath.Join(d, "qemu-tls"),
		ServerRoot: filepath.Join(d, "pki"), AdminURI: "libvirtd:///system?socket=" + filepath.Join(d, "run", "libvirt-admin-sock")})
	if err := agent.Apply(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The block names the copies under the server root, which this
	// libvirtd also sees at /etc/pki, where it reloads them from.
	_, cert, _ := libvirttls.ServerFiles(filepath.Join(d, "pki"))
	data, err := os.ReadFile(conf)
	if err != nil || !strings.Contains(string(data), `cert_file = "`+cert+`"`) {
		t.Fatalf("libvirtd.conf %v:\n%s", err, data)
	}
	script := "set -e\n"
	for _, b := range [][2]string{{"etc", "/etc/libvirt"}, {"run", "/run/libvirt"}, {"lib", "/var/lib/libvirt"},
		{"cache", "/var/cache/libvirt"}, {"log", "/var/log/libvirt"}, {"pki/CA", "/etc/pki/CA"}, {"pki/libvirt", "/etc/pki/libvirt"}} {
		script += fmt.Sprintf("mount --bind %s %s\n", filepath.Join(d, b[0]), b[1])
	}
	script += "exec libvirtd --listen -f /etc/libvirt/libvirtd.conf -p " + filepath.Join(d, "libvirtd.pid") + "\n"
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script)
	logf, err := os.Create(filepath.Join(d, "libvirtd.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("libvirtd log:\n%s", b)
		}
	})
	return agent
}
