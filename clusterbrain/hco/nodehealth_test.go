package hco

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestOnlyNodeHealthChangesSync(t *testing.T) {
	node := func(ready corev1.ConditionStatus, beat time.Time, schedulable string) *corev1.Node {
		return &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: "n1", ResourceVersion: beat.Format(time.RFC3339Nano),
				Labels: map[string]string{schedulableLabel: schedulable}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: ready,
				Reason: "NodeAgentReady", Message: "nodevirt nodeagent is running", LastHeartbeatTime: metav1.NewTime(beat)}}},
		}
	}
	t0 := time.Now()
	base := node(corev1.ConditionTrue, t0, "true")
	for _, tc := range []struct {
		name string
		cur  *corev1.Node
		want bool
	}{
		{"heartbeat", node(corev1.ConditionTrue, t0.Add(10*time.Second), "true"), false},
		{"not ready", node(corev1.ConditionFalse, t0.Add(10*time.Second), "true"), true},
		{"unknown", node(corev1.ConditionUnknown, t0, "true"), true},
		{"unschedulable", node(corev1.ConditionTrue, t0, "false"), true},
	} {
		if got := nodeHealthChanged(base, tc.cur); got != tc.want {
			t.Errorf("%s: nodeHealthChanged = %v, want %v", tc.name, got, tc.want)
		}
	}
	if !nodeHealthChanged("not a node", base) {
		t.Error("an update of something else must sync")
	}
}
