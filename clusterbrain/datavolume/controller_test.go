package datavolume

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{ControllerManager: true})
}

type env struct {
	kube  kubernetes.Interface
	virt  *client.Set
	snaps *snapshotv1.Client
	rest  *rest.Config
	sched *scheduler.Scheduler
	ns    string
}

var (
	setupOnce sync.Once
	shared    env
)

// setup runs the controller alone (no node): tests play the node by
// writing its reports on the PVCs. The CDI CR asks for 10% overhead.
func setup(t *testing.T) env {
	t.Helper()
	cp := controlplane.Shared(t)
	setupOnce.Do(func() {
		ctx := context.Background()
		testkit.InstallCRDs(t, cp)
		testkit.InstallSnapshotCRDs(t, cp)
		kube := cp.Clientset(t)
		virt, err := client.NewSet(cp.RestConfig)
		if err != nil {
			t.Fatal(err)
		}
		cdi := &cdiv1.CDI{ObjectMeta: metav1.ObjectMeta{Name: "cdi"}, Spec: cdiv1.CDISpec{Config: &cdiv1.CDIConfigSpec{
			FilesystemOverhead: &cdiv1.FilesystemOverhead{Global: "0.1"},
			FeatureGates:       []string{featuregate.HonorWaitForFirstConsumer}}}}
		if _, err := virt.CDIs.Create(ctx, cdi); err != nil {
			t.Fatal(err)
		}
		dvimporttest.CreateNode(t, kube, "node-a")
		for _, n := range []*corev1.Node{
			{ObjectMeta: metav1.ObjectMeta{Name: "node-cordoned"}, Spec: corev1.NodeSpec{Unschedulable: true}},
			{ObjectMeta: metav1.ObjectMeta{Name: "node-down"}, Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionFalse}}}},
		} {
			created, err := kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(n.Status.Conditions) > 0 {
				created.Status = n.Status
				if _, err := kube.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
					t.Fatal(err)
				}
			}
		}
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		snaps := snapshotv1.NewClient(dynamic.NewForConfigOrDie(cp.RestConfig))
		if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: brainNamespace}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// Immediately bound claims are placed by a real scheduler, as in
		// the brain.
		sched, err := scheduler.New(scheduler.Config{Kube: kube, Virt: virt, Snapshots: snaps, Log: log})
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = sched.Run(ctx) }()
		c, err := New(Config{Kube: kube, Virt: virt, Snapshots: snaps, Log: log, Namespace: brainNamespace, Placer: sched})
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = c.Run(ctx) }()
		shared = env{kube: kube, virt: virt, snaps: snaps, rest: cp.RestConfig, sched: sched}
	})
	if shared.kube == nil {
		t.Fatal("setup failed earlier")
	}
	e := shared
	e.ns = cp.Namespace(t)
	return e
}

// brainNamespace is where the controller under test writes clone requests.
const brainNamespace = "nodevirt-dv-brain"

func storageDV(ns, name, size string, src *cdiv1.DataVolumeSource) *cdiv1.DataVolume {
	return &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: cdiv1.DataVolumeSpec{Source: src, Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}}}}}
}

func (e env) create(t *testing.T, dv *cdiv1.DataVolume) {
	t.Helper()
	if _, err := e.virt.DataVolumes.Create(context.Background(), dv); err != nil {
		t.Fatal(err)
	}
}

func (e env) wait(t *testing.T, name, what string, ok func(*cdiv1.DataVolume) bool) *cdiv1.DataVolume {
	t.Helper()
	return dvimporttest.WaitDV(t, e.virt.DataVolumes, e.ns, name, 20*time.Second, what, ok)
}

func (e env) waitPVC(t *testing.T, name string, ok func(*corev1.PersistentVolumeClaim) bool) *corev1.PersistentVolumeClaim {
	t.Helper()
	var pvc *corev1.PersistentVolumeClaim
	testkit.Eventually(t, 20*time.Second, "pvc "+name, func() error {
		var err error
		if pvc, err = e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(context.Background(), name, metav1.GetOptions{}); err != nil {
			return err
		}
		if !ok(pvc) {
			return fmt.Errorf("not yet: %+v", pvc)
		}
		return nil
	})
	return pvc
}

func (e env) annotate(t *testing.T, name string, ann map[string]string) {
	t.Helper()
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": ann}})
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Patch(context.Background(), name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestClaimFromStorageSpecUsesDefaultsAndOverhead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.create(t, storageDV(e.ns, "img", "1Gi", &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: "http://example.invalid/disk.img"}}))
	pvc := e.waitPVC(t, "img", func(*corev1.PersistentVolumeClaim) bool { return true })
	if pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != HostpathClass {
		t.Errorf("storage class %v, want the default %s", pvc.Spec.StorageClassName, HostpathClass)
	}
	if len(pvc.Spec.AccessModes) != 1 || pvc.Spec.AccessModes[0] != corev1.ReadWriteOnce || *pvc.Spec.VolumeMode != corev1.PersistentVolumeFilesystem {
		t.Errorf("access modes %v volume mode %v", pvc.Spec.AccessModes, *pvc.Spec.VolumeMode)
	}
	// 1Gi / (1 - 0.1), rounded up to MiB.
	if got, want := pvc.Spec.Resources.Requests.Storage().Value(), int64(1138<<20); got != want {
		t.Errorf("requested %d bytes, want %d", got, want)
	}
	if pvc.Annotations[importstate.AnnUsableSize] != fmt.Sprint(1<<30) || pvc.Annotations[importstate.AnnSource] != "http" ||
		pvc.Annotations[importstate.AnnEndpoint] != "http://example.invalid/disk.img" {
		t.Errorf("annotations %v", pvc.Annotations)
	}
	dv, _ := e.virt.DataVolumes.Get(context.Background(), e.ns, "img")
	if !metav1.IsControlledBy(pvc, dv) {
		t.Errorf("pvc is not owned by the datavolume: %+v", pvc.OwnerReferences)
	}
	e.wait(t, "img", "WaitForFirstConsumer", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.WaitForFirstConsumer })

	// spec.pvc is taken as written; the usable size is net of overhead.
	block := corev1.PersistentVolumeBlock
	raw := &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Name: "raw", Namespace: e.ns},
		Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}},
			PVC: &corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1000Mi")}}}}}
	e.create(t, raw)
	pvc = e.waitPVC(t, "raw", func(*corev1.PersistentVolumeClaim) bool { return true })
	if pvc.Spec.Resources.Requests.Storage().Value() != 1000<<20 || pvc.Annotations[importstate.AnnUsableSize] != fmt.Sprint(900<<20) {
		t.Errorf("spec.pvc claim: %v, usable %s", pvc.Spec.Resources.Requests.Storage(), pvc.Annotations[importstate.AnnUsableSize])
	}
	raw2 := raw.DeepCopy()
	raw2.Name = "rawblock"
	raw2.Spec.PVC.VolumeMode = &block
	e.create(t, raw2)
	pvc = e.waitPVC(t, "rawblock", func(*corev1.PersistentVolumeClaim) bool { return true })
	if pvc.Annotations[importstate.AnnUsableSize] != fmt.Sprint(1000<<20) {
		t.Errorf("block volume usable %s, want all of it", pvc.Annotations[importstate.AnnUsableSize])
	}
}

func TestNodeReportsBecomeDataVolumeStatus(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dvimporttest.Provision(ctx, t, e.kube, e.ns, "node-a")
	dv := storageDV(e.ns, "rep", "64Mi", &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: "http://example.invalid/disk.img"}})
	dv.Annotations = map[string]string{importstate.AnnImmediateBinding: "true"}
	e.create(t, dv)
	pvc := e.waitPVC(t, "rep", func(p *corev1.PersistentVolumeClaim) bool { return p.Status.Phase == corev1.ClaimBound })
	if pvc.Annotations[importstate.AnnSelectedNode] != "node-a" {
		t.Errorf("immediate binding chose %q, want the only usable node node-a", pvc.Annotations[importstate.AnnSelectedNode])
	}
	e.wait(t, "rep", "ImportScheduled", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.ImportScheduled })
	e.annotate(t, "rep", map[string]string{importstate.AnnPhase: "Running", importstate.AnnProgress: "42.17%"})
	got := e.wait(t, "rep", "progress", func(dv *cdiv1.DataVolume) bool { return dv.Status.Progress == "42.17%" })
	if got.Status.Phase != cdiv1.ImportInProgress || dvimporttest.Condition(got, cdiv1.DataVolumeRunning).Status != corev1.ConditionTrue {
		t.Errorf("in progress: %+v", got.Status)
	}
	e.annotate(t, "rep", map[string]string{importstate.AnnRestarts: "1", importstate.AnnReason: "SourceUnreachable", importstate.AnnMessage: "503"})
	got = e.wait(t, "rep", "restart", func(dv *cdiv1.DataVolume) bool { return dv.Status.RestartCount == 1 })
	if c := dvimporttest.Condition(got, cdiv1.DataVolumeRunning); c.Status != corev1.ConditionFalse || c.Reason != "SourceUnreachable" || c.Message != "503" {
		t.Errorf("running condition after a failed attempt: %+v", c)
	}
	e.annotate(t, "rep", map[string]string{importstate.AnnPhase: "Succeeded", importstate.AnnReason: "Completed", importstate.AnnMessage: ""})
	got = e.wait(t, "rep", "Succeeded", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Succeeded })
	if got.Status.Progress != "100.0%" || dvimporttest.Condition(got, cdiv1.DataVolumeReady).Status != corev1.ConditionTrue || got.Status.RestartCount != 1 {
		t.Errorf("succeeded: %+v", got.Status)
	}
}

func TestSourceRefWaitsForItsDataSource(t *testing.T) {
	t.Parallel()
	e := setup(t)
	dv := storageDV(e.ns, "fromref", "64Mi", nil)
	dv.Spec.SourceRef = &cdiv1.DataVolumeSourceRef{Kind: "DataSource", Name: "fedora"}
	e.create(t, dv)
	got := e.wait(t, "fromref", "DataSourceNotFound", func(dv *cdiv1.DataVolume) bool {
		return dvimporttest.Condition(dv, cdiv1.DataVolumeBound).Reason == "DataSourceNotFound"
	})
	if got.Status.Phase != cdiv1.Pending {
		t.Errorf("phase %s without its datasource", got.Status.Phase)
	}
	ds := &cdiv1.DataSource{ObjectMeta: metav1.ObjectMeta{Name: "fedora", Namespace: e.ns},
		Spec: cdiv1.DataSourceSpec{Source: cdiv1.DataSourceSource{PVC: &cdiv1.DataVolumeSourcePVC{Name: "golden"}}}}
	if _, err := e.virt.DataSources.Create(context.Background(), ds); err != nil {
		t.Fatal(err)
	}
	pvc := e.waitPVC(t, "fromref", func(*corev1.PersistentVolumeClaim) bool { return true })
	if pvc.Annotations[importstate.AnnCloneRequest] != e.ns+"/golden" || pvc.Annotations[importstate.AnnSource] != "pvc" {
		t.Errorf("clone pvc annotations %v", pvc.Annotations)
	}
	// The node takes the source from the brain's clone request, in the
	// brain's namespace, for this very claim.
	var cm *corev1.ConfigMap
	testkit.Eventually(t, 20*time.Second, "the clone request of pvc "+pvc.Name, func() (err error) {
		cm, err = e.kube.CoreV1().ConfigMaps(brainNamespace).Get(context.Background(), importstate.CloneRequestName(pvc.UID), metav1.GetOptions{})
		return err
	})
	req, err := importstate.ReadCloneRequest(cm, pvc)
	if err != nil {
		t.Fatal(err)
	}
	if req.SourceNamespace != e.ns || req.SourceName != "golden" {
		t.Errorf("clone request %+v", req)
	}
	e.wait(t, "fromref", "WaitForFirstConsumer", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.WaitForFirstConsumer })
}

func TestRefusedSourcesAndForeignClaims(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.create(t, storageDV(e.ns, "s3", "64Mi", &cdiv1.DataVolumeSource{S3: &cdiv1.DataVolumeSourceS3{URL: "s3://b/k"}}))
	// A clone from another namespace that no webhook authorized (no
	// stamp), and one whose source is not the one stamped.
	e.create(t, storageDV(e.ns, "xns", "64Mi", &cdiv1.DataVolumeSource{PVC: &cdiv1.DataVolumeSourcePVC{Namespace: "default", Name: "x"}}))
	moved := storageDV(e.ns, "moved", "64Mi", &cdiv1.DataVolumeSource{PVC: &cdiv1.DataVolumeSourcePVC{Name: "x"}})
	moved.Annotations = map[string]string{AnnAuthorizedSource: "pvc/" + e.ns + "/y"}
	e.create(t, moved)
	for name, reason := range map[string]string{"s3": "UnsupportedSource", "xns": "CloneNotAuthorized", "moved": "CloneSourceChanged"} {
		got := e.wait(t, name, "Failed", func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Failed })
		if c := dvimporttest.Condition(got, cdiv1.DataVolumeRunning); c.Reason != reason {
			t.Errorf("%s: reason %q, want %s", name, c.Reason, reason)
		}
	}
	// A PVC of the same name that is not the DataVolume's is left alone.
	foreign := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "taken", Namespace: e.ns},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(context.Background(), foreign, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.create(t, storageDV(e.ns, "taken", "64Mi", &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}}))
	e.wait(t, "taken", "ErrResourceExists", func(dv *cdiv1.DataVolume) bool {
		return dvimporttest.Condition(dv, cdiv1.DataVolumeBound).Reason == "ErrResourceExists"
	})
	pvc := e.waitPVC(t, "taken", func(*corev1.PersistentVolumeClaim) bool { return true })
	if len(pvc.OwnerReferences) != 0 || pvc.Annotations[importstate.AnnSource] != "" {
		t.Errorf("foreign pvc was changed: %+v %v", pvc.OwnerReferences, pvc.Annotations)
	}
}

func TestStorageProfilesFollowStorageClasses(t *testing.T) {
	t.Parallel()
	e := setup(t)
	testkit.Eventually(t, 20*time.Second, "storage profile "+HostpathClass, func() error {
		p, err := e.virt.StorageProfiles.Get(context.Background(), "", HostpathClass)
		if err != nil {
			return err
		}
		if len(p.Status.ClaimPropertySets) != 2 || p.Status.Provisioner == nil || *p.Status.Provisioner != HostpathProvisioner {
			return fmt.Errorf("not yet: %+v", p.Status)
		}
		return nil
	})
	sc, err := e.kube.StorageV1().StorageClasses().Get(context.Background(), HostpathClass, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if sc.Annotations[defaultClassAnnotation] != "true" || *sc.VolumeBindingMode != "WaitForFirstConsumer" || sc.Provisioner != HostpathProvisioner {
		t.Errorf("storage class %+v", sc)
	}
}
