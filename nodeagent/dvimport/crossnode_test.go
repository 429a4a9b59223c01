package dvimport_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestCloneAcrossNodes: a clone whose volume is on another node than its
// source's is streamed from the source node's endpoint over mutual TLS,
// byte for byte; a node holding no claim the brain asked to clone the
// volume, and the upload proxy, are refused the volume, and so is the
// destination once its clone is done.
func TestCloneAcrossNodes(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The brain's namespace: the node CA and the clone requests.
	const brainNS = "kubevirt-hyperconverged"
	ca, err := uploadtls.EnsureCA(ctx, e.kube, brainNS)
	if err != nil {
		t.Fatal(err)
	}
	// Two nodes with agents and endpoints of their own, unschedulable so
	// that the brain's placements for the other tests avoid them.
	src, dst := "xn-src-"+e.ns, "xn-dst-"+e.ns
	resolvers := map[string]dvimporttest.DirResolver{}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	for _, name := range []string{src, dst} {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{importstate.HostpathTopologyKey: name}},
			Spec: corev1.NodeSpec{Unschedulable: true}}
		if _, err := e.kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.kube.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
		resolvers[name] = dvimporttest.DirResolver{Root: t.TempDir()}
		agent, err := dvimport.New(dvimport.Config{NodeName: name, Kube: e.kube, Virt: e.virt, Resolver: resolvers[name], Log: log,
			BrainNamespace: brainNS, UploadAddr: "127.0.0.1:0", UploadAdvertiseIP: "127.0.0.1",
			HTTPRetries: -1, RetryDelay: 100 * time.Millisecond, ProgressInterval: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { defer close(done); _ = agent.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
		dvimporttest.Provision(ctx, t, e.kube, e.ns, name)
	}

	golden := newDV(e.ns, "golden", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: im.srv.URL + "/disk.qcow2"}}, false)
	golden.Annotations = map[string]string{importstate.AnnSelectedNode: src}
	e.create(t, golden)
	e.waitPhase(t, "golden", cdiv1.Succeeded, 60*time.Second)

	far := newDV(e.ns, "far", "64Mi", cdiv1.DataVolumeSource{PVC: &cdiv1.DataVolumeSourcePVC{Namespace: e.ns, Name: "golden"}}, false)
	far.Annotations = map[string]string{importstate.AnnSelectedNode: dst}
	start := time.Now()
	e.create(t, far)
	e.waitPhase(t, "far", cdiv1.Succeeded, 60*time.Second)
	t.Logf("cross-node clone of a 64 MiB volume: %v", time.Since(start).Round(time.Millisecond))
	pvc := e.pvc(t, "far")
	if got := pvc.Annotations[importstate.AnnNode]; got != dst {
		t.Errorf("clone filled by node %q, want %s", got, dst)
	}
	dvimporttest.SameDisk(t, resolvers[dst].Disk(pvc), im.raw)

	// The source's endpoint refuses whoever has no clone there.
	n, err := e.kube.CoreV1().Nodes().Get(ctx, src, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	url := n.Annotations[importstate.NodeUploadEndpoint] + dvimport.ExportPath + e.ns + "/golden"
	for _, who := range []string{identity.NodeUserPrefix + "xn-other", identity.UploadProxyClientName} {
		cert, err := ca.Issue(who, nil, nil, true)
		if err != nil {
			t.Fatal(err)
		}
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{cert},
			RootCAs: ca.Pool(), ServerName: identity.UploadServerName}}}
		resp, err := hc.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s read the volume: %s", who, resp.Status)
		}
		hc.CloseIdleConnections()
	}
	// Once the clone is done the brain withdraws its clone request: the
	// destination node itself is refused from then on.
	cert, err := ca.Issue(identity.NodeUserPrefix+dst, nil, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{cert},
		RootCAs: ca.Pool(), ServerName: identity.UploadServerName}}}
	defer hc.CloseIdleConnections()
	testkit.Poll(t, 20*time.Second, dst+" refused the source after its clone completed", func() (bool, error) {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		req.Header.Set("Range", "bytes=0-511")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusForbidden, fmt.Errorf("it still reads it: %d", resp.StatusCode)
	})
}
