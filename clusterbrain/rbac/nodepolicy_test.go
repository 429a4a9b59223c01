package rbac_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// nodeConfig is the rest configuration of node's agent (client
// certificate: CN system:node:<node>, O nodevirt:nodes).
func nodeConfig(t *testing.T, cp *controlplane.ControlPlane, node string) *rest.Config {
	t.Helper()
	kc := filepath.Join(t.TempDir(), node+".kubeconfig")
	if err := cp.WriteKubeconfig(kc, identity.NodeUser(node), identity.NodesGroup); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// nodeClient is a client authenticated as node's agent.
func nodeClient(t *testing.T, cp *controlplane.ControlPlane, node string) (kubernetes.Interface, *client.Set) {
	t.Helper()
	cfg := nodeConfig(t, cp, node)
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	virt, err := client.NewSet(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return kube, virt
}

// refused fails t unless err is the API server refusing the write.
func refused(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: allowed", what)
		return
	}
	if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) {
		t.Errorf("%s: %v, want a refusal", what, err)
	}
}

// waitRefused retries write until the API server refuses it (policies
// are loaded asynchronously after they are created).
func waitRefused(t *testing.T, what string, write func() error) {
	t.Helper()
	var err error
	testkit.Until(t, 30*time.Second, what+" refused", func() bool {
		err = write()
		return err != nil
	})
	refused(t, what, err)
}

func allowed(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Errorf("%s: %v", what, err)
	}
}

func annotate(key, value string) []byte {
	data, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{key: value}}})
	return data
}

// A node's credentials write only that node's objects: its Node and
// Lease, the VMIs bound to it, the PVs of its volumes and the claims
// placed on it. It lists no Secrets and gets none, nor any ConfigMap.
func TestNodeWritesOnlyItsOwnObjects(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	admin := cp.Clientset(t)
	testkit.InstallCRDs(t, cp)
	testkit.InstallSnapshotCRDs(t, cp)
	if err := rbac.EnsureDaemons(ctx, admin); err != nil {
		t.Fatal(err)
	}
	adminVirt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	suffix := fmt.Sprint(time.Now().UnixNano() % 100000)
	mine, other := "np-mine-"+suffix, "np-other-"+suffix
	for _, n := range []string{mine, other} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = admin.CoreV1().Nodes().Delete(context.Background(), n, metav1.DeleteOptions{}) })
	}
	kube, virt := nodeClient(t, cp, mine)

	// The API server loads policies in the background: wait until it
	// enforces them (on a write it refuses in every case).
	waitRefused(t, "patch another Node", func() error {
		_, err := kube.CoreV1().Nodes().Patch(ctx, other, types.MergePatchType, annotate("x", "1"), metav1.PatchOptions{})
		return err
	})

	// Nodes.
	_, err = kube.CoreV1().Nodes().Patch(ctx, other, types.MergePatchType, annotate("x", "2"), metav1.PatchOptions{})
	refused(t, "patch another Node", err)
	_, err = kube.CoreV1().Nodes().Patch(ctx, mine, types.MergePatchType, annotate("x", "1"), metav1.PatchOptions{})
	allowed(t, "patch its own Node", err)
	_, err = kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "np-forged-" + suffix}}, metav1.CreateOptions{})
	refused(t, "create a Node of another name", err)

	// Leases.
	lease := func(name string) *coordinationv1.Lease {
		return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: rbac.NodeLeaseNamespace}}
	}
	if _, err := admin.CoordinationV1().Leases(rbac.NodeLeaseNamespace).Create(ctx, lease(other), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitRefused(t, "patch another node's Lease", func() error {
		_, err := kube.CoordinationV1().Leases(rbac.NodeLeaseNamespace).Patch(ctx, other, types.MergePatchType, annotate("x", "1"), metav1.PatchOptions{})
		return err
	})
	_, err = kube.CoordinationV1().Leases(rbac.NodeLeaseNamespace).Create(ctx, lease("np-forged-"+suffix), metav1.CreateOptions{})
	refused(t, "create a Lease of another name", err)
	_, err = kube.CoordinationV1().Leases(rbac.NodeLeaseNamespace).Create(ctx, lease(mine), metav1.CreateOptions{})
	allowed(t, "create its own Lease", err)

	// VMIs: one bound to each node.
	for _, n := range []string{mine, other} {
		vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "on-" + n, Namespace: ns},
			Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Resources: kubevirtv1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}}}}}
		vmi, err := adminVirt.VMIs.Create(ctx, vmi)
		if err != nil {
			t.Fatal(err)
		}
		vmi.Status.NodeName, vmi.Status.Phase = n, kubevirtv1.Scheduled
		if _, err := adminVirt.VMIs.UpdateStatus(ctx, vmi); err != nil {
			t.Fatal(err)
		}
	}
	waitRefused(t, "patch a VMI bound to another node", func() error {
		_, err := virt.VMIs.Patch(ctx, ns, "on-"+other, types.MergePatchType, annotate("x", "1"), metav1.PatchOptions{})
		return err
	})
	theirs, err := virt.VMIs.Get(ctx, ns, "on-"+other)
	if err != nil {
		t.Fatal(err) // reading is not restricted
	}
	theirs.Status.Phase = kubevirtv1.Failed
	_, err = virt.VMIs.UpdateStatus(ctx, theirs)
	refused(t, "update the status of a VMI bound to another node", err)
	theirs, _ = virt.VMIs.Get(ctx, ns, "on-"+other)
	theirs.Status.NodeName = mine
	_, err = virt.VMIs.UpdateStatus(ctx, theirs)
	refused(t, "take a VMI of another node", err)
	theirs, _ = virt.VMIs.Get(ctx, ns, "on-"+other)
	theirs.Labels = map[string]string{"stolen": "true"}
	_, err = virt.VMIs.Update(ctx, theirs)
	refused(t, "update a VMI bound to another node", err)
	own, err := virt.VMIs.Get(ctx, ns, "on-"+mine)
	if err != nil {
		t.Fatal(err)
	}
	own.Status.Phase = kubevirtv1.Running
	_, err = virt.VMIs.UpdateStatus(ctx, own)
	allowed(t, "update the status of its own VMI", err)
	own, _ = virt.VMIs.Get(ctx, ns, "on-"+mine)
	own.Status.NodeName = other
	_, err = virt.VMIs.UpdateStatus(ctx, own)
	refused(t, "hand its VMI to another node", err)

	// Migrations: the status of those it takes part in (package
	// migstate), never who takes part.
	for _, m := range []struct{ name, source, target string }{{"mig-mine", "np-x-" + suffix, mine}, {"mig-other", other, "np-x-" + suffix}} {
		mig, err := adminVirt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
			ObjectMeta: metav1.ObjectMeta{Name: m.name, Namespace: ns}, Spec: kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: "on-" + other}})
		if err != nil {
			t.Fatal(err)
		}
		mig.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{SourceNode: m.source, TargetNode: m.target}
		if _, err := adminVirt.Migrations.UpdateStatus(ctx, mig); err != nil {
			t.Fatal(err)
		}
	}
	waitRefused(t, "update the status of a migration it has no part in", func() error {
		m, err := virt.Migrations.Get(ctx, ns, "mig-other")
		if err != nil {
			return err
		}
		m.Status.MigrationState.TargetNodeAddress = "10.0.0.9"
		_, err = virt.Migrations.UpdateStatus(ctx, m)
		return err
	})
	ours, err := virt.Migrations.Get(ctx, ns, "mig-mine")
	if err != nil {
		t.Fatal(err)
	}
	ours.Status.MigrationState.TargetNodeAddress = "10.0.0.1"
	_, err = virt.Migrations.UpdateStatus(ctx, ours)
	allowed(t, "report its part in a migration", err)
	ours, _ = virt.Migrations.Get(ctx, ns, "mig-mine")
	ours.Status.MigrationState.SourceNode = mine
	_, err = virt.Migrations.UpdateStatus(ctx, ours)
	refused(t, "change a migration's source node", err)
	ours, _ = virt.Migrations.Get(ctx, ns, "mig-mine")
	ours.Spec.VMIName = "on-" + mine
	_, err = virt.Migrations.Update(ctx, ours)
	refused(t, "update a migration's spec", err)
	_, err = virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{Name: "mig-forged", Namespace: ns}, Spec: kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: "on-" + mine}})
	refused(t, "create a migration", err)

	// PVs.
	pv := func(name, node string) *corev1.PersistentVolume {
		return &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: "kubevirt.io.hostpath-provisioner", VolumeHandle: name}},
				NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
					MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "topology.hostpath.csi/node",
						Operator: corev1.NodeSelectorOpIn, Values: []string{node}}}}}}},
			}}
	}
	for _, name := range []string{"np-pv-forged-" + suffix, "np-pv-mine-" + suffix, "np-pv-other-" + suffix} {
		t.Cleanup(func() {
			_ = admin.CoreV1().PersistentVolumes().Delete(context.Background(), name, metav1.DeleteOptions{})
		})
	}
	if _, err := admin.CoreV1().PersistentVolumes().Create(ctx, pv("np-pv-other-"+suffix, other), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitRefused(t, "patch a PV of another node", func() error {
		_, err := kube.CoreV1().PersistentVolumes().Patch(ctx, "np-pv-other-"+suffix, types.MergePatchType, annotate("x", "1"), metav1.PatchOptions{})
		return err
	})
	_, err = kube.CoreV1().PersistentVolumes().Create(ctx, pv("np-pv-forged-"+suffix, other), metav1.CreateOptions{})
	refused(t, "create a PV on another node", err)
	_, err = kube.CoreV1().PersistentVolumes().Create(ctx, pv("np-pv-mine-"+suffix, mine), metav1.CreateOptions{})
	allowed(t, "create a PV on its own node", err)
	err = kube.CoreV1().PersistentVolumes().Delete(ctx, "np-pv-other-"+suffix, metav1.DeleteOptions{})
	refused(t, "delete a PV of another node", err)

	// Claims placed on each node.
	for _, n := range []string{mine, other} {
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "claim-" + n, Namespace: ns,
			Annotations: map[string]string{"volume.kubernetes.io/selected-node": n}},
			Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
		if _, err := admin.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitRefused(t, "report on a claim placed on another node", func() error {
		_, err := kube.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, "claim-"+other, types.MergePatchType,
			annotate("cdi.kubevirt.io/storage.pod.phase", "Succeeded"), metav1.PatchOptions{})
		return err
	})
	_, err = kube.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, "claim-"+mine, types.MergePatchType,
		annotate("cdi.kubevirt.io/storage.pod.phase", "Running"), metav1.PatchOptions{})
	allowed(t, "report on its own claim", err)
	_, err = kube.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, "claim-"+mine, types.MergePatchType,
		annotate("volume.kubernetes.io/selected-node", other), metav1.PatchOptions{})
	refused(t, "move its claim to another node", err)

	// VolumeSnapshotContents: its own, and unclaimed pre-provisioned ones
	// it claims; not another node's.
	snaps := snapshotv1.NewClient(dynamic.NewForConfigOrDie(cp.RestConfig))
	nodeSnaps := snapshotv1.NewClient(dynamic.NewForConfigOrDie(nodeConfig(t, cp, mine)))
	content := func(name, node string) *snapshotv1.VolumeSnapshotContent {
		handle := "snap-" + name
		c := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: "kubevirt.io.hostpath-provisioner", DeletionPolicy: snapshotv1.VolumeSnapshotContentRetain,
				VolumeSnapshotRef: corev1.ObjectReference{Namespace: ns, Name: "vs-" + name},
				Source:            snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &handle}}}
		if node != "" {
			c.Annotations = map[string]string{snapshotv1.AnnNode: node}
		}
		return c
	}
	for _, c := range []*snapshotv1.VolumeSnapshotContent{content("np-vsc-other-"+suffix, other), content("np-vsc-free-"+suffix, "")} {
		if _, err := snaps.Contents.Create(ctx, c); err != nil {
			t.Fatal(err)
		}
		name := c.Name
		t.Cleanup(func() { _ = snaps.Contents.Delete(context.Background(), "", name) })
	}
	t.Cleanup(func() { _ = snaps.Contents.Delete(context.Background(), "", "np-vsc-mine-"+suffix) })
	waitRefused(t, "update another node's volumesnapshotcontent", func() error {
		c, err := nodeSnaps.Contents.Get(ctx, "", "np-vsc-other-"+suffix)
		if err != nil {
			return err
		}
		c.Labels = map[string]string{"x": "1"}
		_, err = nodeSnaps.Contents.Update(ctx, c)
		return err
	})
	err = nodeSnaps.Contents.Delete(ctx, "", "np-vsc-other-"+suffix)
	refused(t, "delete another node's volumesnapshotcontent", err)
	_, err = nodeSnaps.Contents.Create(ctx, content("np-vsc-forged-"+suffix, other))
	refused(t, "create a volumesnapshotcontent on another node", err)
	_, err = nodeSnaps.Contents.Create(ctx, content("np-vsc-mine-"+suffix, mine))
	allowed(t, "create a volumesnapshotcontent of its own", err)
	free, err := nodeSnaps.Contents.Get(ctx, "", "np-vsc-free-"+suffix)
	if err != nil {
		t.Fatal(err)
	}
	free.Annotations = map[string]string{snapshotv1.AnnNode: mine}
	_, err = nodeSnaps.Contents.Update(ctx, free)
	allowed(t, "claim an unclaimed pre-provisioned volumesnapshotcontent", err)

	// Events: only with itself as source host.
	event := func(name, host string) *corev1.Event {
		return &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			InvolvedObject: corev1.ObjectReference{Kind: "VirtualMachineInstance", Namespace: ns, Name: "on-" + mine},
			Reason:         "Test", Message: "test", Type: corev1.EventTypeNormal, Source: corev1.EventSource{Component: "virt-handler", Host: host}}
	}
	waitRefused(t, "create an event as another node", func() error {
		_, err := kube.CoreV1().Events(ns).Create(ctx, event("np-ev-forged-"+suffix, other), metav1.CreateOptions{})
		return err
	})
	_, err = kube.CoreV1().Events(ns).Create(ctx, event("np-ev-nohost-"+suffix, ""), metav1.CreateOptions{})
	refused(t, "create an event without a source host", err)
	_, err = kube.CoreV1().Events(ns).Create(ctx, event("np-ev-mine-"+suffix, mine), metav1.CreateOptions{})
	allowed(t, "create an event of its own", err)

	// Secrets: never listed or watched, and none in the brain's namespace.
	_, err = kube.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
	refused(t, "list secrets cluster-wide", err)
	_, err = kube.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
	refused(t, "list secrets of a namespace", err)
	if err == nil || !strings.Contains(err.Error(), "forbidden") {
		t.Logf("list in namespace: %v", err)
	}
	// Nor read one, or a ConfigMap, by name: what its VMIs and DataVolumes
	// name comes through the brain (clusterbrain/nodereads).
	if _, err := admin.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "unused"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = kube.CoreV1().Secrets(ns).Get(ctx, "unused", metav1.GetOptions{})
	refused(t, "get a secret no VMI on it uses", err)
	_, err = kube.CoreV1().ConfigMaps(ns).Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
	refused(t, "get a configmap", err)
}
