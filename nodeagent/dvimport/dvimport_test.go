package dvimport_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/datavolume"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{ControllerManager: true})
}

const node = "node-a"

type env struct {
	kube     kubernetes.Interface
	virt     *client.Set
	ns       string
	resolver dvimporttest.DirResolver
}

var (
	setupOnce sync.Once
	shared    env
)

// setup starts, once per test binary, the brain's DataVolume controller and
// this node's dvimport role against the shared control plane, and gives the
// test its own namespace with a provisioner for node-a.
func setup(t *testing.T) env {
	t.Helper()
	cp := controlplane.Shared(t)
	setupOnce.Do(func() {
		ctx := context.Background()
		testkit.InstallCRDs(t, cp)
		kube := cp.Clientset(t)
		virt, err := client.NewSet(cp.RestConfig)
		if err != nil {
			t.Fatal(err)
		}
		dvimporttest.CreateNode(t, kube, node)
		// The test image servers listen on loopback, which imports may
		// reach only when the CDI CR allows it; WaitForFirstConsumer claims
		// wait for their consumer with CDI's gate on, as HCO renders it.
		cdi := &cdiv1.CDI{ObjectMeta: metav1.ObjectMeta{Name: "cdi",
			Annotations: map[string]string{importstate.AnnImportAllowedNetworks: "127.0.0.0/8,::1"}},
			Spec: cdiv1.CDISpec{Config: &cdiv1.CDIConfigSpec{FeatureGates: []string{featuregate.HonorWaitForFirstConsumer}}}}
		if _, err := virt.CDIs.Create(ctx, cdi); err != nil {
			t.Fatal(err)
		}
		// The brain's namespace, where it writes clone requests.
		brainNS := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kubevirt-hyperconverged"}}
		if _, err := kube.CoreV1().Namespaces().Create(ctx, brainNS, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		ctrl, err := datavolume.New(datavolume.Config{Kube: kube, Virt: virt, Log: log})
		if err != nil {
			t.Fatal(err)
		}
		root, err := os.MkdirTemp("", "dvimport-volumes-")
		if err != nil {
			t.Fatal(err)
		}
		resolver := dvimporttest.DirResolver{Root: root}
		agent, err := dvimport.New(dvimport.Config{NodeName: node, Kube: kube, Virt: virt, Resolver: resolver, Log: log,
			HTTPRetries: -1, RetryDelay: 100 * time.Millisecond, ProgressInterval: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = ctrl.Run(ctx) }()
		go func() { _ = agent.Run(ctx) }()
		shared = env{kube: kube, virt: virt, resolver: resolver}
	})
	if shared.kube == nil {
		t.Fatal("setup failed earlier")
	}
	e := shared
	e.ns = cp.Namespace(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	dvimporttest.Provision(ctx, t, e.kube, e.ns, node)
	return e
}

// newDV is a DataVolume written the way CDI's documentation writes them.
func newDV(ns, name string, size string, src cdiv1.DataVolumeSource, immediate bool) *cdiv1.DataVolume {
	dv := &cdiv1.DataVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: cdiv1.DataVolumeSpec{
			Source: &src,
			Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}}},
		},
	}
	if immediate {
		dv.Annotations = map[string]string{importstate.AnnImmediateBinding: "true"}
	}
	return dv
}

func (e env) create(t *testing.T, dv *cdiv1.DataVolume) {
	t.Helper()
	if _, err := e.virt.DataVolumes.Create(context.Background(), dv); err != nil {
		t.Fatalf("create datavolume %s: %v", dv.Name, err)
	}
}

// waitDV polls the DataVolume until ok says so.
func (e env) waitDV(t *testing.T, name string, timeout time.Duration, what string, ok func(*cdiv1.DataVolume) bool) *cdiv1.DataVolume {
	t.Helper()
	return dvimporttest.WaitDV(t, e.virt.DataVolumes, e.ns, name, timeout, what, ok)
}

func (e env) waitPhase(t *testing.T, name string, phase cdiv1.DataVolumePhase, timeout time.Duration) *cdiv1.DataVolume {
	t.Helper()
	return e.waitDV(t, name, timeout, "phase "+string(phase), func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == phase })
}

func (e env) pvc(t *testing.T, name string) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

// images serves a raw image and its qcow2 conversion from a real HTTP
// server.
type images struct {
	dir, raw, qcow2 string
	srv             *httptest.Server
}

func serveImages(t *testing.T) *images {
	t.Helper()
	dir := t.TempDir()
	im := &images{dir: dir}
	im.raw = dvimporttest.MakeImage(t, dir, "disk.raw", 24<<20, 7)
	im.qcow2 = filepath.Join(dir, "disk.qcow2")
	if out, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "qcow2", im.raw, im.qcow2).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v\n%s", err, out)
	}
	im.srv = httptest.NewServer(http.FileServer(http.Dir(dir)))
	t.Cleanup(im.srv.Close)
	return im
}

func TestHTTPImportFillsVolumeWithTheImage(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	sum := dvimporttest.SHA256(t, im.raw)
	e.create(t, newDV(e.ns, "raw", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{
		URL: im.srv.URL + "/disk.raw", Checksum: "sha256:" + sum}}, true))
	e.create(t, newDV(e.ns, "qcow2", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{
		URL: im.srv.URL + "/disk.qcow2"}}, true))
	for _, name := range []string{"raw", "qcow2"} {
		dv := e.waitPhase(t, name, cdiv1.Succeeded, 60*time.Second)
		if dv.Status.Progress != "100.0%" {
			t.Errorf("%s: progress %q, want 100.0%%", name, dv.Status.Progress)
		}
		for typ, want := range map[cdiv1.DataVolumeConditionType]corev1.ConditionStatus{
			cdiv1.DataVolumeBound: corev1.ConditionTrue, cdiv1.DataVolumeReady: corev1.ConditionTrue, cdiv1.DataVolumeRunning: corev1.ConditionFalse,
		} {
			if c := dvimporttest.Condition(dv, typ); c.Status != want {
				t.Errorf("%s: condition %s is %q, want %q", name, typ, c.Status, want)
			}
		}
		if dv.Status.ClaimName != name {
			t.Errorf("%s: claimName %q", name, dv.Status.ClaimName)
		}
		pvc := e.pvc(t, name)
		disk := e.resolver.Disk(pvc)
		dvimporttest.SameDisk(t, disk, im.raw)
		st, err := os.Stat(disk)
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() != 64<<20 {
			t.Errorf("%s: disk is %d bytes, want the requested 64Mi", name, st.Size())
		}
		// The claim is larger than the request by the filesystem overhead.
		if got := pvc.Spec.Resources.Requests.Storage().Value(); got <= 64<<20 {
			t.Errorf("%s: pvc requests %d bytes, want more than 64Mi for the overhead", name, got)
		}
	}
	waitEvent(t, e, "raw", "ImportSucceeded")

	// The node's /metrics has the imports' duration and source bytes.
	rec := httptest.NewRecorder()
	metrics.Default().Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	for _, want := range []string{`nodevirt_import_duration_seconds_count{source="http",result="ok"}`,
		`nodevirt_import_source_bytes_total{source="http"}`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func waitEvent(t *testing.T, e env, name, reason string) {
	t.Helper()
	testkit.Poll(t, 10*time.Second, fmt.Sprintf("event %s for datavolume %s", reason, name), func() (bool, error) {
		evs, err := e.kube.CoreV1().Events(e.ns).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, ev := range evs.Items {
			if ev.InvolvedObject.Name == name && ev.InvolvedObject.Kind == "DataVolume" && ev.Reason == reason {
				return true, nil
			}
		}
		return false, nil
	})
}

func TestWaitForFirstConsumerUntilANodeIsSelected(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	e.create(t, newDV(e.ns, "wffc", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: im.srv.URL + "/disk.qcow2"}}, false))
	dv := e.waitPhase(t, "wffc", cdiv1.WaitForFirstConsumer, 20*time.Second)
	if c := dvimporttest.Condition(dv, cdiv1.DataVolumeBound); c.Status != corev1.ConditionFalse || c.Reason != "WaitForFirstConsumer" {
		t.Errorf("bound condition %+v", c)
	}
	time.Sleep(time.Second)
	if pvc := e.pvc(t, "wffc"); pvc.Spec.VolumeName != "" || pvc.Annotations[importstate.AnnSelectedNode] != "" {
		t.Fatalf("claim placed without a consumer: %+v", pvc.Annotations)
	}
	// What the scheduler does when it places the VM.
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, importstate.AnnSelectedNode, node)
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Patch(context.Background(), "wffc", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	e.waitPhase(t, "wffc", cdiv1.Succeeded, 60*time.Second)
	dvimporttest.SameDisk(t, e.resolver.Disk(e.pvc(t, "wffc")), im.raw)
}

func TestBadSourcesFailWithReasons(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	dvimporttest.MakeImage(t, im.dir, "big.raw", 40<<20, 3)
	garbage := filepath.Join(im.dir, "garbage.qcow2")
	data, _ := os.ReadFile(im.qcow2)
	if err := os.WriteFile(garbage, data[:len(data)/2], 0o644); err != nil {
		t.Fatal(err)
	}
	// Hostile images naming a host file: a VMDK descriptor whose FLAT
	// extent is /etc/passwd, a qcow2 whose backing file is.
	if err := os.WriteFile(filepath.Join(im.dir, "flat.vmdk"), []byte("# Disk DescriptorFile\nversion=1\nCID=fffffffe\n"+
		"parentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 4 FLAT \"/etc/passwd\" 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", "/etc/passwd",
		filepath.Join(im.dir, "backing.qcow2"), "16M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v\n%s", err, out)
	}
	cases := []struct {
		name, url, checksum, size, reason string
	}{
		{"hostile-vmdk", "/flat.vmdk", "", "64Mi", "UnsupportedImage"},
		{"hostile-qcow2", "/backing.qcow2", "", "64Mi", "UnsupportedImage"},
		{"notfound", "/missing.img", "", "64Mi", "SourceNotFound"},
		{"checksum", "/disk.raw", "sha256:" + fmt.Sprintf("%064x", 1), "64Mi", "ChecksumMismatch"},
		{"toolarge", "/big.raw", "", "32Mi", "ImageTooLarge"},
		{"truncated", "/garbage.qcow2", "", "64Mi", "ImageTruncated"},
	}
	for _, c := range cases {
		e.create(t, newDV(e.ns, c.name, c.size, cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{
			URL: im.srv.URL + c.url, Checksum: c.checksum}}, true))
	}
	for _, c := range cases {
		dv := e.waitPhase(t, c.name, cdiv1.Failed, 60*time.Second)
		running := dvimporttest.Condition(dv, cdiv1.DataVolumeRunning)
		if running.Status != corev1.ConditionFalse || running.Reason != c.reason || running.Message == "" {
			t.Errorf("%s: running condition %+v, want reason %s", c.name, running, c.reason)
		}
		if dv.Status.RestartCount != 0 {
			t.Errorf("%s: a permanent failure was retried %d times", c.name, dv.Status.RestartCount)
		}
		if strings.HasPrefix(c.name, "hostile") && !strings.Contains(running.Message, "/etc/passwd") {
			t.Errorf("%s: message %q does not name the host file", c.name, running.Message)
		}
		disk := e.resolver.Disk(e.pvc(t, c.name))
		if _, err := os.Stat(disk); !os.IsNotExist(err) {
			t.Errorf("%s: failed import left %s (%v)", c.name, disk, err)
		}
		entries, _ := os.ReadDir(filepath.Dir(disk))
		if len(entries) != 0 {
			t.Errorf("%s: failed import left files: %v", c.name, entries)
		}
	}
	waitEvent(t, e, "checksum", "ErrorChecksumMismatch")
}

func TestTransientFailuresRestartAndCount(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	var calls atomic.Int32
	files := http.FileServer(http.Dir(im.dir))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) <= 2 {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		files.ServeHTTP(w, r)
	}))
	defer srv.Close()
	e.create(t, newDV(e.ns, "flaky", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: srv.URL + "/disk.raw"}}, true))
	dv := e.waitPhase(t, "flaky", cdiv1.Succeeded, 60*time.Second)
	if dv.Status.RestartCount != 2 {
		t.Errorf("restartCount %d, want 2", dv.Status.RestartCount)
	}
	dvimporttest.SameDisk(t, e.resolver.Disk(e.pvc(t, "flaky")), im.raw)

	// A source that never comes back fails after the restarts.
	dead := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "down", http.StatusBadGateway)
	}))
	defer dead.Close()
	e.create(t, newDV(e.ns, "dead", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: dead.URL + "/disk.raw"}}, true))
	dv = e.waitPhase(t, "dead", cdiv1.Failed, 60*time.Second)
	if dv.Status.RestartCount != 3 || dvimporttest.Condition(dv, cdiv1.DataVolumeRunning).Reason != "SourceUnreachable" {
		t.Errorf("restartCount %d, running %+v", dv.Status.RestartCount, dvimporttest.Condition(dv, cdiv1.DataVolumeRunning))
	}
}

var progressRE = regexp.MustCompile(`^\d{1,3}\.\d{2}%$`)

func TestProgressAndDeletionCancelsImport(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	image, err := os.ReadFile(im.raw)
	if err != nil {
		t.Fatal(err)
	}
	gone := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(len(image)))
		w.WriteHeader(http.StatusOK)
		for off := 0; off < len(image); off += 256 << 10 {
			if _, err := w.Write(image[off : off+256<<10]); err != nil {
				break
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				close(gone)
				return
			case <-time.After(150 * time.Millisecond):
			}
		}
	}))
	defer srv.Close()
	e.create(t, newDV(e.ns, "slow", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: srv.URL + "/disk.raw"}}, true))
	dv := e.waitDV(t, "slow", 30*time.Second, "progress", func(dv *cdiv1.DataVolume) bool {
		return dv.Status.Phase == cdiv1.ImportInProgress && dv.Status.Progress != "N/A" && dv.Status.Progress != "0.00%"
	})
	if !progressRE.MatchString(string(dv.Status.Progress)) {
		t.Errorf("progress %q does not read NN.NN%%", dv.Status.Progress)
	}
	if c := dvimporttest.Condition(dv, cdiv1.DataVolumeRunning); c.Status != corev1.ConditionTrue {
		t.Errorf("running condition %+v while importing", c)
	}
	disk := e.resolver.Disk(e.pvc(t, "slow"))
	if err := e.virt.DataVolumes.Delete(context.Background(), e.ns, "slow", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the import still reads its source after the datavolume was deleted")
	}
	testkit.Eventually(t, 5*time.Second, "the canceled import's files removed", func() error {
		if entries, _ := os.ReadDir(filepath.Dir(disk)); len(entries) > 0 {
			return fmt.Errorf("left: %v", entries)
		}
		return nil
	})
}

func TestBlankAndSameNodeClone(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	e.create(t, newDV(e.ns, "blank", "16Mi", cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}}, true))
	e.create(t, newDV(e.ns, "golden", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: im.srv.URL + "/disk.qcow2"}}, true))
	e.waitPhase(t, "blank", cdiv1.Succeeded, 30*time.Second)
	disk := e.resolver.Disk(e.pvc(t, "blank"))
	data, err := os.ReadFile(disk)
	if err != nil {
		t.Fatal(err)
	}
	if len(data) != 16<<20 || !allZero(data) {
		t.Errorf("blank disk: %d bytes, zero %v", len(data), allZero(data))
	}
	e.waitPhase(t, "golden", cdiv1.Succeeded, 60*time.Second)

	// Clone written with sourceRef through a DataSource, as VM templates do.
	ds := &cdiv1.DataSource{ObjectMeta: metav1.ObjectMeta{Name: "golden-ds", Namespace: e.ns},
		Spec: cdiv1.DataSourceSpec{Source: cdiv1.DataSourceSource{PVC: &cdiv1.DataVolumeSourcePVC{Namespace: e.ns, Name: "golden"}}}}
	if _, err := e.virt.DataSources.Create(context.Background(), ds); err != nil {
		t.Fatal(err)
	}
	clone := newDV(e.ns, "clone", "64Mi", cdiv1.DataVolumeSource{}, true)
	clone.Spec.Source = nil
	clone.Spec.SourceRef = &cdiv1.DataVolumeSourceRef{Kind: "DataSource", Name: "golden-ds"}
	e.create(t, clone)
	dv := e.waitPhase(t, "clone", cdiv1.Succeeded, 60*time.Second)
	if dv.Status.Progress != "100.0%" {
		t.Errorf("clone progress %q", dv.Status.Progress)
	}
	pvc := e.pvc(t, "clone")
	if pvc.Annotations[importstate.AnnCloneRequest] != e.ns+"/golden" || pvc.Annotations[importstate.AnnSelectedNode] != node {
		t.Errorf("clone pvc annotations %v", pvc.Annotations)
	}
	dvimporttest.SameDisk(t, e.resolver.Disk(pvc), im.raw)
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// The node side ignores claims of other nodes.
func TestOtherNodesVolumesAreLeftAlone(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	// node-b takes no placements of the brain, so that the parallel tests
	// keep landing on node-a.
	nb := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-b"}, Spec: corev1.NodeSpec{Unschedulable: true}}
	if _, err := e.kube.CoreV1().Nodes().Create(context.Background(), nb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.create(t, newDV(e.ns, "elsewhere", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: im.srv.URL + "/disk.raw"}}, false))
	e.waitPhase(t, "elsewhere", cdiv1.WaitForFirstConsumer, 20*time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dvimporttest.Provision(ctx, t, e.kube, e.ns, "node-b")
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"node-b"}}}`, importstate.AnnSelectedNode)
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Patch(ctx, "elsewhere", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	e.waitPhase(t, "elsewhere", cdiv1.ImportScheduled, 30*time.Second)
	time.Sleep(2 * time.Second)
	dv, err := e.virt.DataVolumes.Get(ctx, e.ns, "elsewhere")
	if err != nil {
		t.Fatal(err)
	}
	if dv.Status.Phase != cdiv1.ImportScheduled {
		t.Errorf("node-a worked on node-b's volume: phase %s", dv.Status.Phase)
	}
	if _, err := os.Stat(e.resolver.Disk(e.pvc(t, "elsewhere"))); !os.IsNotExist(err) {
		t.Errorf("node-a wrote node-b's volume: %v", err)
	}
}

// An import cut short by a stopped agent starts again, counted as a
// restart, when the agent comes back.
func TestAgentRestartResumesImport(t *testing.T) {
	t.Parallel()
	e := setup(t)
	im := serveImages(t)
	image, err := os.ReadFile(im.raw)
	if err != nil {
		t.Fatal(err)
	}
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(len(image)))
		slow := requests.Add(1) == 1
		for off := 0; off < len(image); off += 256 << 10 {
			if _, err := w.Write(image[off : off+256<<10]); err != nil {
				return
			}
			if slow {
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
					return
				case <-time.After(200 * time.Millisecond):
				}
			}
		}
	}))
	defer srv.Close()

	const nodeC = "node-c"
	nc := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeC}, Spec: corev1.NodeSpec{Unschedulable: true}}
	if _, err := e.kube.CoreV1().Nodes().Create(context.Background(), nc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dvimporttest.Provision(ctx, t, e.kube, e.ns, nodeC)
	resolver := dvimporttest.DirResolver{Root: t.TempDir()}
	startAgent := func(ctx context.Context) chan struct{} {
		a, err := dvimport.New(dvimport.Config{NodeName: nodeC, Kube: e.kube, Virt: e.virt, Resolver: resolver,
			ProgressInterval: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { defer close(done); _ = a.Run(ctx) }()
		return done
	}
	first, stopFirst := context.WithCancel(ctx)
	firstDone := startAgent(first)

	e.create(t, newDV(e.ns, "resume", "64Mi", cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: srv.URL + "/disk.raw"}}, false))
	e.waitPhase(t, "resume", cdiv1.WaitForFirstConsumer, 20*time.Second)
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, importstate.AnnSelectedNode, nodeC)
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Patch(ctx, "resume", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	e.waitPhase(t, "resume", cdiv1.ImportInProgress, 30*time.Second)
	stopFirst()
	<-firstDone
	if requests.Load() != 1 {
		t.Fatalf("%d requests before the restart", requests.Load())
	}
	// What an agent killed mid-import (not stopped) leaves behind.
	disk := resolver.Disk(e.pvc(t, "resume"))
	crashed := []string{"." + filepath.Base(disk) + ".importing-crashed", "." + filepath.Base(disk) + ".spill-crashed", ".clone-crashed"}
	for _, n := range crashed {
		if err := os.WriteFile(filepath.Join(filepath.Dir(disk), n), []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	startAgent(ctx)
	dv := e.waitPhase(t, "resume", cdiv1.Succeeded, 60*time.Second)
	if dv.Status.RestartCount != 1 {
		t.Errorf("restartCount %d after one agent restart, want 1", dv.Status.RestartCount)
	}
	dvimporttest.SameDisk(t, resolver.Disk(e.pvc(t, "resume")), im.raw)
	for _, n := range crashed {
		if _, err := os.Stat(filepath.Join(filepath.Dir(disk), n)); err == nil {
			t.Errorf("leftover %s of the interrupted import is still there", n)
		}
	}
}
