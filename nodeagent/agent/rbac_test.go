package agent

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/clusterbrain/nodecerts"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/clusterbrain/subresources"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// logBuffer collects every log line (the agent's and client-go's).
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	os.Stderr.Write(p)
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestAgentUnderNodeRole runs the whole agent authenticated as
// system:node:<name> in group nodevirt:nodes, bound to nothing but the
// daemon roles, against the real API server with the brain's signer and
// node Secret access running: it registers its Node, gets its certificate,
// serves the brain's console client with it, and no call of any role is
// forbidden. It may not read the brain's Secrets.
func TestAgentUnderNodeRole(t *testing.T) {
	cp := controlplane.Shared(t)
	admin := cp.Clientset(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	testkit.InstallCRDs(t, cp)
	testkit.InstallSnapshotCRDs(t, cp)
	brainNS := cp.Namespace(t)
	userNS := cp.Namespace(t)

	logs := &logBuffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	klog.SetSlogLogger(log) // reflectors' list/watch errors land in logs too
	defer klog.ClearLogger()

	// The administrator installs the daemon roles (the brain repairs them
	// later); the brain runs the signer.
	if err := rbac.EnsureDaemons(ctx, admin); err != nil {
		t.Fatal(err)
	}
	signer, err := nodecerts.New(nodecerts.Config{Kube: admin, Namespace: brainNS, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	go signer.Run(ctx)

	node := fmt.Sprintf("rbac-node-%d", time.Now().UnixNano()%100000)
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	if err := cp.WriteKubeconfig(kc, identity.NodeUser(node), identity.NodesGroup); err != nil {
		t.Fatal(err)
	}
	state := t.TempDir()
	// The agent's pools get shared bind mounts of their volumes directories.
	testkit.UnmountBelowAtCleanup(t, state)
	consoleAddr, healthAddr := freePort(t), freePort(t)
	a, err := New(Config{Kubeconfig: kc, NodeName: node, StateDir: state, HealthAddr: healthAddr,
		Emulation: EmulationOn, LibvirtURI: libvirttest.Ensure(t), CSISocket: filepath.Join(state, "csi.sock"),
		Console:        console.Config{Addr: consoleAddr},
		BrainNamespace: brainNS, UploadAddr: "127.0.0.1:0",
		MetricsAddr: "127.0.0.1:0", PodCIDR: "-", Log: log})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("agent: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Error("agent did not stop within 20s")
		}
	}()
	// Whatever fails below, report what the role refused.
	defer func() {
		for _, line := range strings.Split(logs.String(), "\n") {
			if l := strings.ToLower(line); strings.Contains(l, "forbidden") || strings.Contains(l, "role stopped") {
				t.Errorf("under the node role: %s", line)
			}
		}
	}()

	// Ready: Node registered and every role healthy.
	testkit.Until(t, 45*time.Second, "agent ready", func() bool {
		resp, err := http.Get("http://" + healthAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := n.Annotations[identity.NodeAddressAnnotation]; got != consoleAddr {
		t.Errorf("console advertised at %q, want %s", got, consoleAddr)
	}

	// The brain's console client reaches this node's console with the
	// node's issued certificate: a VMI it does not run answers 404.
	ca, err := uploadtls.EnsureCA(ctx, admin, brainNS)
	if err != nil {
		t.Fatal(err)
	}
	brainTLS, err := subresources.NodeTLS(ca)
	if err != nil {
		t.Fatal(err)
	}
	var callErr error
	testkit.Until(t, 30*time.Second, "console with the node certificate", func() bool {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, callErr = (&console.Client{Addr: consoleAddr, TLS: brainTLS}).Console(cctx, userNS, "absent")
		return callErr != nil && strings.Contains(callErr.Error(), "404")
	})

	// The upload endpoint serves the node certificate too: the brain's
	// upload proxy reaches it (a claim it does not hold answers 404).
	testkit.Until(t, 30*time.Second, "upload endpoint advertised", func() bool {
		n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		return err == nil && n.Annotations[importstate.NodeUploadEndpoint] != ""
	})
	n, err = admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	proxyCert, err := ca.Issue(identity.UploadProxyClientName, nil, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{proxyCert},
		RootCAs: ca.Pool(), ServerName: identity.UploadServerName}}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Post(n.Annotations[importstate.NodeUploadEndpoint]+dvimport.UploadPath+userNS+"/absent", "application/octet-stream", strings.NewReader("x"))
	if err != nil {
		t.Fatalf("upload endpoint on the node certificate: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("upload into a claim the node does not hold: %s, want 404", resp.Status)
	}

	// Secrets and ConfigMaps: none directly, neither a user namespace's
	// nor the brain's (what its VMIs and DataVolumes name comes through the
	// brain's nodereads API, tested in clusterbrain/nodereads).
	nodeKube := kubeFor(t, kc)
	if _, err := admin.CoreV1().Secrets(userNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "cloudinit"},
		StringData: map[string]string{"userdata": "#cloud-config"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := nodeKube.CoreV1().Secrets(userNS).Get(ctx, "cloudinit", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("node reading a user namespace's secret: %v, want forbidden", err)
	}
	if _, err := nodeKube.CoreV1().Secrets(brainNS).Get(ctx, identity.UploadCASecretName, metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("node reading the node CA secret: %v, want forbidden", err)
	}
	if _, err := nodeKube.CoreV1().ConfigMaps(userNS).Get(ctx, "kube-root-ca.crt", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("node reading a user namespace's configmap: %v, want forbidden", err)
	}
	// Nor may it take the brain's leader lease or create VMs.
	if _, err := nodeKube.CoordinationV1().Leases(brainNS).Get(ctx, "nodevirt-clusterbrain", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("node reading the brain's lease: %v, want forbidden", err)
	}

	// Let the roles run a while; the deferred check finds nothing
	// forbidden in any log line.
	time.Sleep(3 * time.Second)
}

func kubeFor(t *testing.T, kubeconfig string) kubernetes.Interface {
	t.Helper()
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return kube
}
