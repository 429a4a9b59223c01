package hostpathprovisioner

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/poolstate"
)

func agentNode(name string, ready bool, labels map[string]string, pools ...poolstate.PoolState) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{schedulableLabel: "true"},
		Annotations: map[string]string{poolstate.AnnotationNodePools: poolstate.Encode(poolstate.NodePools{Pools: pools})}}}
	for k, v := range labels {
		n.Labels[k] = v
	}
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: st}}
	return n
}

// Status counts the ready agents the placement selects, names each node's
// failure, refuses pvcTemplate pools, and keeps transition times.
func TestStatusFromNodeReports(t *testing.T) {
	hpp := &hppv1beta1.HostPathProvisioner{ObjectMeta: metav1.ObjectMeta{Name: "hpp", Generation: 3},
		Spec: hppv1beta1.HostPathProvisionerSpec{
			StoragePools: []hppv1beta1.StoragePool{{Name: "a", Path: "/a"}, {Name: "b", Path: "/b", PVCTemplate: &corev1.PersistentVolumeClaimSpec{}}},
			Workload:     hppv1beta1.NodePlacement{NodeSelector: map[string]string{"disk": "ssd"}}}}
	ready := poolstate.PoolState{Name: "a", Provisioner: "hpp", Phase: poolstate.PhaseReady}
	failed := poolstate.PoolState{Name: "a", Provisioner: "hpp", Phase: poolstate.PhaseFailed, Message: "mkdir /a/csi: read-only file system"}
	other := poolstate.PoolState{Name: "a", Provisioner: "another", Phase: poolstate.PhaseReady}
	nodes := []*corev1.Node{
		agentNode("n1", true, map[string]string{"disk": "ssd"}, ready),
		agentNode("n2", true, map[string]string{"disk": "ssd"}, failed),
		agentNode("n3", true, map[string]string{"disk": "ssd"}, other),  // not yet for this provisioner
		agentNode("n4", false, map[string]string{"disk": "ssd"}, ready), // not ready: not counted
		agentNode("n5", true, map[string]string{"disk": "hdd"}, ready),  // not selected
	}
	now := time.Now()
	st := Status(hpp, nodes, "v1", now)
	if len(st.StoragePoolStatuses) != 2 {
		t.Fatalf("pool statuses %+v", st.StoragePoolStatuses)
	}
	a, b := st.StoragePoolStatuses[0], st.StoragePoolStatuses[1]
	if a.Name != "a" || a.DesiredReady != 3 || a.CurrentReady != 1 || a.Phase != hppv1beta1.StoragePoolPreparing {
		t.Errorf("pool a %+v, want 1 of 3 ready, preparing", a)
	}
	if b.Phase != hppv1beta1.StoragePoolRefused {
		t.Errorf("pool b %+v, want refused", b)
	}
	conds := map[string]string{}
	for _, c := range st.Conditions {
		conds[c.Type] = c.Status + " " + c.Message
	}
	if !strings.HasPrefix(conds["Available"], "True") {
		t.Errorf("available %q", conds["Available"])
	}
	if d := conds["Degraded"]; !strings.HasPrefix(d, "True") || !strings.Contains(d, "node n2: storage pool a failed: mkdir") ||
		!strings.Contains(d, "storage pool b refused") {
		t.Errorf("degraded %q", d)
	}
	if p := conds["Progressing"]; !strings.HasPrefix(p, "True") || !strings.Contains(p, "node n3 has not reported storage pool a") {
		t.Errorf("progressing %q", p)
	}
	if st.ObservedGeneration != 3 || st.OperatorVersion != "v1" || st.Phase != "Deployed" {
		t.Errorf("status %+v", st)
	}

	// All ready: Ready phase; unchanged conditions keep their transition time.
	hpp.Status = st
	nodes[1] = agentNode("n2", true, map[string]string{"disk": "ssd"}, ready)
	nodes[2] = agentNode("n3", true, map[string]string{"disk": "ssd"}, ready)
	st2 := Status(hpp, nodes, "v1", now.Add(time.Minute))
	if a := st2.StoragePoolStatuses[0]; a.CurrentReady != 3 || a.Phase != hppv1beta1.StoragePoolReady {
		t.Errorf("pool a %+v, want 3 of 3, ready", a)
	}
	for _, c := range st2.Conditions {
		if c.Type == "Available" && !c.LastTransitionTime.Time.Equal(st.Conditions[0].LastTransitionTime.Time) {
			t.Errorf("available transition time moved without a change")
		}
	}

	// No selected node: not available, saying so.
	st3 := Status(hpp, nodes[4:], "v1", now)
	if st3.Phase != "Deploying" || !strings.Contains(st3.Conditions[0].Message, "no ready node agent is selected") {
		t.Errorf("without nodes: %+v", st3)
	}
}
