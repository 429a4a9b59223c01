package nodecert_test

import (
	"bufio"
	"context"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/clusterbrain/nodecerts"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/clusterbrain/subresources"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/nodeagent/nodecert"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

var (
	signerOnce sync.Once
	signerNS   = "nodevirt-nodecert-test"
)

// brain starts the one signer of this test binary (two would both sign)
// and installs the daemons' roles; it returns the brain's namespace.
func brain(t *testing.T) string {
	t.Helper()
	cp := controlplane.Shared(t)
	kube := cp.Clientset(t)
	signerOnce.Do(func() {
		ctx := context.Background()
		if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: signerNS}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := rbac.EnsureDaemons(ctx, kube); err != nil {
			t.Fatal(err)
		}
		s, err := nodecerts.New(nodecerts.Config{Kube: kube, Namespace: signerNS})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			if err := s.Run(ctx); err != nil {
				fmt.Fprintln(os.Stderr, "signer:", err)
			}
		}()
	})
	return signerNS
}

// nodeClient is a client authenticated as node's agent.
func nodeClient(t *testing.T, node string) kubernetes.Interface {
	t.Helper()
	cp := controlplane.Shared(t)
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := cp.WriteKubeconfig(path, identity.NodeUser(node), identity.NodesGroup); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return kube
}

func TestNodeGetsItsCertificate(t *testing.T) {
	ns := brain(t)
	node := "cert-node-a"
	dir := t.TempDir()
	src, err := nodecert.New(nodecert.Config{Kube: nodeClient(t, node), NodeName: node, Dir: dir, Wait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if src.Ready() {
		t.Fatal("ready before any request")
	}
	if err := src.Request(context.Background()); err != nil {
		t.Fatal(err)
	}
	leaf := src.Leaf()
	if leaf.Subject.CommonName != identity.NodeUser(node) {
		t.Errorf("subject %v", leaf.Subject)
	}
	ca, err := uploadtls.LoadCA(context.Background(), controlplane.Shared(t).Clientset(t), ns)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{node, identity.HandlerServerName, identity.UploadServerName} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Pool(), DNSName: name,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("node certificate for %s: %v", name, err)
		}
	}
	if life := leaf.NotAfter.Sub(time.Now()); life > 24*time.Hour || life < 23*time.Hour {
		t.Errorf("lifetime %s, want the 24h asked for", life)
	}
	// The key stayed on the node: only its files hold it, 0600.
	st, err := os.Stat(filepath.Join(dir, nodecert.KeyFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("key file: %v %v", st, err)
	}
	// A restarted agent serves the stored certificate without asking.
	again, err := nodecert.New(nodecert.Config{Kube: nodeClient(t, node), NodeName: node, Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if !again.Ready() || again.Leaf().SerialNumber.Cmp(leaf.SerialNumber) != 0 {
		t.Error("stored certificate not reused")
	}
	// The node may not read the CA key.
	if _, err := uploadtls.LoadCA(context.Background(), nodeClient(t, node), ns); err == nil {
		t.Error("a node read the node CA key")
	}
}

func TestRequestsNotMatchingTheNodeAreDenied(t *testing.T) {
	brain(t)
	kubeA := nodeClient(t, "cert-node-b")
	// A request for another node's name, through the requester.
	src, err := nodecert.New(nodecert.Config{Kube: kubeA, NodeName: "cert-node-c", Dir: t.TempDir(), Wait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Request(context.Background()); err == nil || !strings.Contains(err.Error(), "Denied") {
		t.Fatalf("request for another node: %v, want denied", err)
	}
	if src.Ready() {
		t.Error("a denied request left a certificate")
	}
	// Hand-made requests with content no node may have.
	admin := controlplane.Shared(t).Clientset(t)
	if _, err := admin.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cert-node-b"},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "10.9.9.9"}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Node status is a subresource: write the address there.
	n, _ := admin.CoreV1().Nodes().Get(context.Background(), "cert-node-b", metav1.GetOptions{})
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "10.9.9.9"}}
	if _, err := admin.CoreV1().Nodes().UpdateStatus(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	self := pkix.Name{CommonName: identity.NodeUser("cert-node-b"), Organization: []string{identity.NodesGroup}}
	usages := []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}
	cases := []struct {
		name    string
		subject pkix.Name
		dns     []string
		ips     []net.IP
		usages  []certificatesv1.KeyUsage
		want    string // "" means issued
	}{
		{"own name and address", self, []string{"cert-node-b"}, []net.IP{net.ParseIP("10.9.9.9")}, usages, ""},
		{"foreign dns name", self, []string{"kubernetes.default.svc"}, nil, usages, "dns name"},
		{"foreign ip", self, nil, []net.IP{net.ParseIP("10.9.9.8")}, usages, "not an address"},
		{"other organization", pkix.Name{CommonName: self.CommonName, Organization: []string{"system:masters"}}, nil, nil, usages, "organization"},
		{"signing usage", self, nil, nil, append(usages, certificatesv1.UsageCertSign), "usage"},
	}
	for _, c := range cases {
		key, _ := certs.GenerateKey()
		req, err := certs.NewCSR(key, c.subject, c.dns, c.ips)
		if err != nil {
			t.Fatal(err)
		}
		csr, err := kubeA.CertificatesV1().CertificateSigningRequests().Create(context.Background(), &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "handmade-"},
			Spec:       certificatesv1.CertificateSigningRequestSpec{Request: req, SignerName: identity.NodeSignerName, Usages: c.usages},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		got := awaitOutcome(t, kubeA, csr.Name)
		if c.want == "" && got != "issued" || c.want != "" && !strings.Contains(got, c.want) {
			t.Errorf("%s: %s, want %q", c.name, got, c.want)
		}
	}
	// A node cannot approve its own request either.
	key, _ := certs.GenerateKey()
	req, _ := certs.NewCSR(key, pkix.Name{CommonName: identity.NodeUser("cert-node-c"), Organization: []string{identity.NodesGroup}}, nil, nil)
	csr, err := kubeA.CertificatesV1().CertificateSigningRequests().Create(context.Background(), &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "selfapprove-"},
		Spec:       certificatesv1.CertificateSigningRequestSpec{Request: req, SignerName: identity.NodeSignerName, Usages: usages},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue})
	if _, err := kubeA.CertificatesV1().CertificateSigningRequests().UpdateApproval(context.Background(), csr.Name, csr, metav1.UpdateOptions{}); err == nil {
		t.Error("a node approved a certificate request")
	}
}

// awaitOutcome is "issued" or the denial's message.
func awaitOutcome(t *testing.T, kube kubernetes.Interface, name string) string {
	t.Helper()
	outcome := ""
	testkit.Until(t, 30*time.Second, "an outcome of csr "+name, func() bool {
		csr, err := kube.CertificatesV1().CertificateSigningRequests().Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(csr.Status.Certificate) > 0 {
			outcome = "issued"
			return true
		}
		for _, c := range csr.Status.Conditions {
			if c.Type == certificatesv1.CertificateDenied || c.Type == certificatesv1.CertificateFailed {
				outcome = string(c.Type) + ": " + c.Message
			}
		}
		return outcome != ""
	})
	return outcome
}

func TestRenewal(t *testing.T) {
	brain(t)
	node := "cert-node-renew"
	src, err := nodecert.New(nodecert.Config{Kube: nodeClient(t, node), NodeName: node, Dir: t.TempDir(),
		Duration: 10 * time.Minute, RenewBefore: 10*time.Minute - 3*time.Second,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- src.Run(ctx) }()
	defer func() { cancel(); <-done }()
	first := waitLeaf(t, src, nil)
	second := waitLeaf(t, src, first)
	if !second.NotAfter.After(first.NotAfter) {
		t.Errorf("renewed certificate expires %s, first %s", second.NotAfter, first.NotAfter)
	}
	t.Logf("renewed %s after the first certificate", second.NotBefore.Sub(first.NotBefore))
}

func waitLeaf(t *testing.T, src *nodecert.Source, not *x509.Certificate) *x509.Certificate {
	t.Helper()
	var leaf *x509.Certificate
	testkit.Until(t, 30*time.Second, "a (new) certificate", func() bool {
		leaf = src.Leaf()
		return leaf != nil && (not == nil || leaf.SerialNumber.Cmp(not.SerialNumber) != 0)
	})
	return leaf
}

// echo is a console backend answering "echo: <line>" on every stream.
type echo struct{}

func (echo) open() (io.ReadWriteCloser, error) {
	a, b := net.Pipe()
	go func() {
		defer b.Close()
		sc := bufio.NewScanner(b)
		for sc.Scan() {
			if _, err := fmt.Fprintf(b, "echo: %s\n", sc.Text()); err != nil {
				return
			}
		}
	}()
	return a, nil
}
func (e echo) Console(context.Context, string, string) (io.ReadWriteCloser, error) { return e.open() }
func (e echo) VNC(context.Context, string, string) (io.ReadWriteCloser, error)     { return e.open() }
func (echo) Pause(context.Context, string, string) error                           { return nil }
func (echo) Unpause(context.Context, string, string) error                         { return nil }
func (echo) SoftReboot(context.Context, string, string) error                      { return nil }
func (echo) Reset(context.Context, string, string) error                           { return nil }
func (echo) Shutdown(context.Context, string, string) error                        { return nil }

// TestConsoleWithIssuedCertificates runs a node's console server on its
// issued certificate and calls it with the brain's client (the
// subresource API's TLS from the node CA): the stream works, and a client
// certificate a node could make for itself is refused.
func TestConsoleWithIssuedCertificates(t *testing.T) {
	ns := brain(t)
	node := "cert-node-console"
	src, err := nodecert.New(nodecert.Config{Kube: nodeClient(t, node), NodeName: node, Dir: t.TempDir(), Wait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Request(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv, err := console.New(console.Config{Addr: "127.0.0.1:0", TLS: src.ServerTLS(),
		AllowedClients: []string{identity.SubresourcesClientName}}, echo{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- srv.Run(ctx) }()
	defer func() { cancel(); <-done }()

	ca, err := uploadtls.EnsureCA(context.Background(), controlplane.Shared(t).Clientset(t), ns)
	if err != nil {
		t.Fatal(err)
	}
	brainTLS, err := subresources.NodeTLS(ca)
	if err != nil {
		t.Fatal(err)
	}
	c := &console.Client{Addr: srv.Addr(), TLS: brainTLS}
	conn, err := c.Console(context.Background(), "ns", "vm")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintln(conn, "hello")
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || line != "echo: hello\n" {
		t.Fatalf("console answered %q, %v", line, err)
	}
	if err := c.Do(context.Background(), "ns", "vm", "pause"); err != nil {
		t.Errorf("pause: %v", err)
	}
	// The node's own certificate (client usage, node CA) is not the brain.
	nodeAsClient := brainTLS.Clone()
	nodeAsClient.Certificates = nil
	nodeAsClient.GetClientCertificate = src.GetClientCertificate
	if err := (&console.Client{Addr: srv.Addr(), TLS: nodeAsClient}).Do(context.Background(), "ns", "vm", "pause"); err == nil ||
		!strings.Contains(err.Error(), "403") {
		t.Errorf("a node's certificate called another node's console: %v", err)
	}
	// And the brain refuses a server certificate from another CA.
	other, err := certs.CreateCA("other", time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	wrong := brainTLS.Clone()
	wrong.RootCAs = other.Pool()
	if _, err := (&console.Client{Addr: srv.Addr(), TLS: wrong}).Console(context.Background(), "ns", "vm"); err == nil {
		t.Error("the brain trusted a node certificate of another CA")
	}
}
