package scheduler

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestPlaceVolume: a volume placed before any consumer goes where the
// VMI policy ranks best: the emptier node, among the eligible ones.
func TestPlaceVolume(t *testing.T) {
	e := setup(t)
	e.node("pv-busy", nodeSpec{cpu: "4", mem: "4Gi"})
	e.node("pv-idle", nodeSpec{cpu: "4", mem: "4Gi"})
	e.vmi("load", "2Gi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": "pv-busy"}
	})
	e.wantNode("load", "pv-busy")
	ours := func(n *corev1.Node) string {
		if !strings.HasPrefix(n.Name, "pv-") {
			return "not ours"
		}
		return ""
	}
	place := func(fit func(*corev1.Node) string) (node, why string) {
		t.Helper()
		testkit.Until(t, 30*time.Second, "the scheduler ready to place volumes", func() (ok bool) {
			node, why, ok = e.sched.PlaceVolume(fit)
			return ok
		})
		return node, why
	}
	for _, tc := range []struct {
		name    string
		fit     func(*corev1.Node) string
		want    string
		wantWhy string
	}{
		{"the emptier node", ours, "pv-idle", ""},
		{"only the busy one fits", func(n *corev1.Node) string {
			if n.Name != "pv-busy" {
				return "not busy"
			}
			return ""
		}, "pv-busy", ""},
		{"none fits", func(n *corev1.Node) string {
			if strings.HasPrefix(n.Name, "pv-") {
				return "ours, refused"
			}
			return "not ours"
		}, "", "2 ours, refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why := place(tc.fit)
			if got != tc.want || !strings.Contains(why, tc.wantWhy) || (tc.want == "") != strings.HasPrefix(why, "0/") {
				t.Errorf("PlaceVolume = %q, %q; want %q, a reason with %q", got, why, tc.want, tc.wantWhy)
			}
		})
	}
}
