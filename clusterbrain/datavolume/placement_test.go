package datavolume

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestImmediatePlacementHonoursTopologiesAndTaints: a volume placed at
// once (an upload into an Immediate class of the hostpath driver, a
// DataVolume bound immediately in a WaitForFirstConsumer class) goes only
// to a node of its class's allowedTopologies (by kubernetes.io/hostname or
// any node label) whose NoSchedule taints CDI's workload placement
// tolerates; when no node can take it the DataVolume stays Pending with a
// Bound condition and a warning event saying why, and is placed once the
// CDI CR tolerates the taint.
//
// Not parallel: its nodes must not take the other tests' volumes, and it
// changes the CDI CR's workload placement.
func TestImmediatePlacementHonoursTopologiesAndTaints(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	tainted := corev1.Taint{Key: "dedicated", Value: "vms", Effect: corev1.TaintEffectNoSchedule}
	e.placementNode(t, "topo-a", map[string]string{"rack": "r1"})
	e.placementNode(t, "topo-b", map[string]string{"rack": "r2"}, tainted)

	immediate, wffc := storagev1.VolumeBindingImmediate, storagev1.VolumeBindingWaitForFirstConsumer
	byHost := e.topologyClass(t, "topo-host-"+e.ns, immediate, corev1.LabelHostname, "topo-b")
	byRack := e.topologyClass(t, "topo-rack-"+e.ns, wffc, "rack", "r1")

	// The upload's only allowed node is tainted: Pending, saying why.
	up := storageDV(e.ns, "up", "64Mi", &cdiv1.DataVolumeSource{Upload: &cdiv1.DataVolumeSourceUpload{}})
	up.Spec.Storage.StorageClassName = &byHost
	e.create(t, up)
	wants := []string{"not in storage class " + byHost + "'s allowedTopologies", "1 taint dedicated:NoSchedule not tolerated by cdi spec.workload.tolerations"}
	got := e.wait(t, "up", "a Bound condition saying why no node takes it", func(dv *cdiv1.DataVolume) bool {
		c := dvimporttest.Condition(dv, cdiv1.DataVolumeBound)
		for _, want := range wants {
			if !strings.Contains(c.Message, want) {
				return false
			}
		}
		return c.Reason == "NoNodeAvailable" && c.Status == corev1.ConditionFalse
	})
	if got.Status.Phase != cdiv1.Pending {
		t.Errorf("phase %s, want Pending", got.Status.Phase)
	}
	if pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(ctx, "up", metav1.GetOptions{}); err != nil || pvc.Annotations[importstate.AnnSelectedNode] != "" {
		t.Fatalf("claim up placed on %q while no node may take it (err %v)", pvc.Annotations[importstate.AnnSelectedNode], err)
	}
	e.waitWarning(t, "up", "NoNodeAvailable")

	// CDI's workload placement tolerates the taint: the upload goes there.
	e.setWorkloadTolerations(t, []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "vms", Effect: corev1.TaintEffectNoSchedule}})
	t.Cleanup(func() { e.setWorkloadTolerations(t, nil) })
	e.waitPlaced(t, "up", "topo-b", "its class's allowedTopologies")

	// A node-label topology key, in a WaitForFirstConsumer class, bound
	// immediately.
	blank := storageDV(e.ns, "blank", "64Mi", &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}})
	blank.Annotations = map[string]string{importstate.AnnImmediateBinding: "true"}
	blank.Spec.Storage.StorageClassName = &byRack
	e.create(t, blank)
	e.waitPlaced(t, "blank", "topo-a", "rack r1")
}

// waitWarning waits for a warning event of reason on the object called
// name whose message says each of wants.
func (e env) waitWarning(t *testing.T, name, reason string, wants ...string) {
	t.Helper()
	testkit.Eventually(t, 30*time.Second, "a "+reason+" warning event on "+name, func() error {
		evs, err := e.kube.CoreV1().Events(e.ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name + ",reason=" + reason})
		if err != nil {
			return err
		}
		if len(evs.Items) == 0 || evs.Items[0].Type != corev1.EventTypeWarning {
			return fmt.Errorf("events %+v", evs.Items)
		}
		for _, want := range wants {
			if !strings.Contains(evs.Items[0].Message, want) {
				return fmt.Errorf("event %q does not say %q", evs.Items[0].Message, want)
			}
		}
		return nil
	})
}

// waitPlaced waits until claim name is placed on node, failing at once
// when it is placed on another (outside what allowed names).
func (e env) waitPlaced(t *testing.T, name, node, allowed string) {
	t.Helper()
	e.waitPVC(t, name, func(pvc *corev1.PersistentVolumeClaim) bool {
		if n := pvc.Annotations[importstate.AnnSelectedNode]; n != "" && n != node {
			t.Fatalf("claim %s placed on %s, outside %s", name, n, allowed)
		}
		return pvc.Annotations[importstate.AnnSelectedNode] == node
	})
}

// placementNode makes a Ready node (its Lease renewed) with an upload
// endpoint, its hostname and the given labels and taints; it is deleted at
// the end of the test, once the scheduler no longer sees it.
func (e env) placementNode(t *testing.T, name string, labels map[string]string, taints ...corev1.Taint) {
	t.Helper()
	ctx := context.Background()
	dvimporttest.CreateNode(t, e.kube, name)
	t.Cleanup(func() {
		_ = e.kube.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
		testkit.Until(t, 30*time.Second, "the scheduler to forget node "+name, func() bool {
			node, _, ok := e.sched.PlaceVolume(func(n *corev1.Node) string {
				if n.Name != name {
					return "another"
				}
				return ""
			})
			return ok && node == ""
		})
	})
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := e.kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Labels[corev1.LabelHostname] = name
		for k, v := range labels {
			n.Labels[k] = v
		}
		if n.Annotations == nil {
			n.Annotations = map[string]string{}
		}
		n.Annotations[importstate.NodeUploadEndpoint] = "192.0.2.1:8447"
		n.Spec.Taints = append(n.Spec.Taints, taints...)
		_, err = e.kube.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// topologyClass makes a class of the hostpath driver allowing only the
// nodes whose label key is value.
func (e env) topologyClass(t *testing.T, name string, mode storagev1.VolumeBindingMode, key, value string) string {
	t.Helper()
	return e.poolClass(t, name, HostpathProvisioner, mode, "", key, value)
}

// poolClass makes a class of provisioner on pool (when set), allowing only
// the nodes whose label key is value (when key is set); it is deleted at
// the end of the test.
func (e env) poolClass(t *testing.T, name, provisioner string, mode storagev1.VolumeBindingMode, pool, key, value string) string {
	t.Helper()
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: provisioner, VolumeBindingMode: &mode}
	if pool != "" {
		sc.Parameters = map[string]string{"storagePool": pool}
	}
	if key != "" {
		sc.AllowedTopologies = []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{{Key: key, Values: []string{value}}}}}
	}
	if _, err := e.kube.StorageV1().StorageClasses().Create(context.Background(), sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.kube.StorageV1().StorageClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// setWorkloadTolerations sets the CDI CR's spec.workload.tolerations.
func (e env) setWorkloadTolerations(t *testing.T, tols []corev1.Toleration) {
	t.Helper()
	ctx := context.Background()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cdi, err := e.virt.CDI(ctx)
		if err != nil {
			return err
		}
		cdi.Spec.Workloads.Tolerations = tols
		_, err = e.virt.CDIs.Update(ctx, cdi)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}
