package nodefailure

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

func TestDecideFollowsTheTimeline(t *testing.T) {
	const grace, window, margin = 20 * time.Second, 30 * time.Second, 10 * time.Second
	renewed := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name       string
		after      time.Duration
		agentReady corev1.ConditionStatus
		oos        bool
		ready      corev1.ConditionStatus
		taint      string
		lost       bool
	}{
		{"fresh", 5 * time.Second, corev1.ConditionTrue, false, corev1.ConditionTrue, "", false},
		{"agent not ready", 5 * time.Second, corev1.ConditionFalse, false, corev1.ConditionFalse, corev1.TaintNodeNotReady, false},
		{"past grace", 21 * time.Second, corev1.ConditionTrue, false, corev1.ConditionUnknown, corev1.TaintNodeUnreachable, false},
		{"past window, within margin", 35 * time.Second, corev1.ConditionTrue, false, corev1.ConditionUnknown, corev1.TaintNodeUnreachable, false},
		{"past window and margin", 41 * time.Second, corev1.ConditionTrue, false, corev1.ConditionUnknown, corev1.TaintNodeUnreachable, true},
		{"out of service, lease fresh", time.Second, corev1.ConditionTrue, true, corev1.ConditionTrue, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := Decide(renewed.Add(tc.after), renewed, tc.agentReady, tc.oos, grace, window, margin)
			if s.Ready != tc.ready || s.Lost != tc.lost {
				t.Errorf("ready %s lost %v, want %s %v", s.Ready, s.Lost, tc.ready, tc.lost)
			}
			if tc.taint == "" && len(s.Taints) != 0 {
				t.Errorf("taints %v, want none", s.Taints)
			}
			if tc.taint != "" {
				effects := map[corev1.TaintEffect]bool{}
				for _, ta := range s.Taints {
					if ta.Key != tc.taint {
						t.Errorf("taint %s, want %s", ta.Key, tc.taint)
					}
					effects[ta.Effect] = true
				}
				if !effects[corev1.TaintEffectNoSchedule] || !effects[corev1.TaintEffectNoExecute] {
					t.Errorf("taints %v, want %s NoSchedule and NoExecute", s.Taints, tc.taint)
				}
			}
		})
	}
}
