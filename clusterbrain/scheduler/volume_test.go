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
	ours := func(n *corev1.Node) bool { return strings.HasPrefix(n.Name, "pv-") }
	place := func(eligible func(*corev1.Node) bool) (node string) {
		t.Helper()
		testkit.Until(t, 30*time.Second, "the scheduler ready to place volumes", func() (ok bool) {
			node, ok = e.sched.PlaceVolume(eligible)
			return ok
		})
		return node
	}
	for _, tc := range []struct {
		name     string
		eligible func(*corev1.Node) bool
		want     string
	}{
		{"the emptier node", ours, "pv-idle"},
		{"only the busy one eligible", func(n *corev1.Node) bool { return n.Name == "pv-busy" }, "pv-busy"},
		{"none eligible", func(*corev1.Node) bool { return false }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := place(tc.eligible); got != tc.want {
				t.Errorf("PlaceVolume = %q, want %q", got, tc.want)
			}
		})
	}
}
