package e2e

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/test/lab"
)

// TestCrossNodePlacement: what places VMIs and volumes across nodes.
//   - Affinity between VMIs: a VMI that requires to be near one on the
//     second node goes there, one that requires to be apart goes to the
//     first, each against a preferred node affinity pulling it the other
//     way.
//   - Cordon (spec.unschedulable) of the second node: a VMI that can only
//     run there waits, Unschedulable, while the VMI already there keeps
//     running; uncordoned, it runs there.
//   - Upstream `virtctl image-upload` into a volume placed on the second
//     node: the bytes land in that node's pool.
//   - A DataVolume cloned from a claim on the first node into a volume on
//     the second, for a VM that runs there.
//
// Not parallel: it cordons nodes and lifts the second node's taint for the
// upload, which no other test may see.
func TestCrossNodePlacement(t *testing.T) {
	e := require(t)
	node2 := e.secondNode(t)
	n := e.namespace(t)
	n.waitNodeReady(node2.Name)

	// Steps in order, not subtests: the namespace's helpers fail the
	// test itself.
	func() {
		t.Log("affinity between VMIs")
		anchor := n.newVMI("anchor", withNodeSelector(node2.Name), onSecondNodeToo())
		anchor.Labels = map[string]string{"e2e/group": "anchor"}
		n.createVMI(anchor)
		n.waitOn("anchor", node2.Name)

		term := corev1.PodAffinityTerm{TopologyKey: corev1.LabelHostname,
			LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"e2e/group": "anchor"}}}
		near := n.newVMI("near", onSecondNodeToo(), preferNode(e.nodeName))
		near.Spec.Affinity.PodAffinity = &corev1.PodAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{term}}
		apart := n.newVMI("apart", onSecondNodeToo(), preferNode(node2.Name))
		apart.Spec.Affinity.PodAntiAffinity = &corev1.PodAntiAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{term}}
		n.createVMI(near)
		n.createVMI(apart)
		n.waitOn("near", node2.Name)
		n.waitOn("apart", e.nodeName)
	}()

	func() {
		t.Log("cordon")
		n.cordon(node2.Name, true)
		defer n.cordon(node2.Name, false)
		n.createVMI(n.newVMI("held", withNodeSelector(node2.Name), onSecondNodeToo()))
		n.waitVMI("held", time.Minute, "Unschedulable while "+node2.Name+" is cordoned", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
			if vmi.Status.NodeName != "" {
				n.t.Fatalf("vmi held was placed on %s, which is cordoned", vmi.Status.NodeName)
			}
			return slices.ContainsFunc(vmi.Status.Conditions, func(c kubevirtv1.VirtualMachineInstanceCondition) bool {
				return string(c.Type) == string(corev1.PodScheduled) && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable
			})
		})
		if vmi, err := n.getVMI("anchor"); err != nil || vmi.Status.Phase != kubevirtv1.Running || domainStateOn(node2, n.name, "anchor") != "running" {
			t.Errorf("cordoning %s touched its running VMI anchor: %s (err %v)", node2.Name, vmiSummary(vmi), err)
		}
		n.cordon(node2.Name, false)
		n.waitOn("held", node2.Name)
	}()

	image := make([]byte, 4<<20)
	rng := rand.NewChaCha8([32]byte{'c', 'r', 'o', 's', 's'})
	_, _ = rng.Read(image[512:]) // a first sector of zeros: no format's magic
	path := filepath.Join(t.TempDir(), "upload.raw")
	if err := os.WriteFile(path, image, 0o644); err != nil {
		t.Fatal(err)
	}
	u := n.upstreamVirtctl()
	proxy := e.uploadProxyURL(t)
	upload := func(name string) {
		u.run(3*time.Minute, "image-upload", "dv", name, "--size=64Mi", "--storage-class=hostpath-csi",
			"--image-path="+path, "--insecure", "--uploadproxy-url="+proxy)
	}

	func() {
		t.Log("upload into a volume on " + node2.Name)
		// The second node is the only one that can take the volume: the
		// first cordoned, the suite's taint lifted.
		n.cordon(e.nodeName, true)
		n.taint(node2.Name, corev1.Taint{Key: secondNodeTaint, Effect: corev1.TaintEffectNoSchedule}, false)
		restore := func() {
			n.taint(node2.Name, corev1.Taint{Key: secondNodeTaint, Effect: corev1.TaintEffectNoSchedule}, true)
			n.cordon(e.nodeName, false)
		}
		defer restore()
		upload("remote-upload")
		restore()
		n.waitDataVolumeSucceeded("remote-upload")
		n.checkVolumeOn(node2, "remote-upload", image)
	}()

	func() {
		t.Log("clone from " + e.nodeName + " into a volume on " + node2.Name)
		upload("golden")
		n.waitDataVolumeSucceeded("golden")
		n.checkVolumeOn(e.firstNode(), "golden", image)
		n.createVM(n.cloneVM("copier", "golden", withNodeSelector(node2.Name), onSecondNodeToo()))
		n.waitVMIOfVM("copier", 3*time.Minute)
		n.waitDataVolumeSucceeded("copier-root")
		n.checkVolumeOn(node2, "copier-root", image)
	}()
}

// preferNode adds a preferred node affinity (weight 100) for node.
func preferNode(node string) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		if s.Affinity == nil {
			s.Affinity = &corev1.Affinity{}
		}
		s.Affinity.NodeAffinity = &corev1.NodeAffinity{PreferredDuringSchedulingIgnoredDuringExecution: []corev1.PreferredSchedulingTerm{{
			Weight: 100, Preference: corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{node}}}}}}}
	}
}

// waitOn waits until VMI name runs, and fails the test unless it runs on
// node.
func (n *testNS) waitOn(name, node string) {
	n.t.Helper()
	vmi := n.waitVMI(name, 2*time.Minute, "Running", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi.Status.Phase == kubevirtv1.Running
	})
	if vmi.Status.NodeName != node {
		n.t.Fatalf("vmi %s runs on %s, want %s", name, vmi.Status.NodeName, node)
	}
}

// cordon sets the node's spec.unschedulable.
func (n *testNS) cordon(node string, on bool) {
	n.t.Helper()
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, on)
	if _, err := n.e.kube.CoreV1().Nodes().Patch(context.Background(), node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		n.t.Fatalf("cordon %s (%v): %v", node, on, err)
	}
}

// firstNode is the suite's first node as a lab.Node: the host, its pool
// under the suite's directory.
func (e *env) firstNode() lab.Node {
	return lab.Node{Name: e.nodeName, Dir: e.root}
}

// readOn reads file path as node sees it: a node of its own namespaces
// keeps its volumes' filesystems mounted there only.
func (e *env) readOn(node lab.Node, path string) ([]byte, error) {
	if node.Name == e.nodeName {
		return os.ReadFile(path)
	}
	argv := lab.EnterCommand(node, "cat", path)
	var stderr bytes.Buffer
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("cat %s on %s: %w: %s", path, node.Name, err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// domainStateOn is the state of the VMI's domain in node's libvirtd.
func domainStateOn(node lab.Node, ns, vmi string) string {
	out, _ := nodeVirsh(node, "domstate", domainName(ns, vmi))
	return strings.TrimSpace(out)
}

// checkVolumeOn checks that the claim's PV is on node and that its disk in
// node's pool holds image, then zeros.
func (n *testNS) checkVolumeOn(node lab.Node, claim string, image []byte) {
	t, e := n.t, n.e
	t.Helper()
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(context.Background(), claim, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv, err := e.kube.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil || pv.Spec.CSI == nil {
		t.Fatalf("pv %q of claim %s: %v", pvc.Spec.VolumeName, claim, err)
	}
	if got := importstate.PVNode(pv); got != node.Name {
		t.Fatalf("the volume of claim %s is on node %q, want %s", claim, got, node.Name)
	}
	disk := filepath.Join(node.Dir, "pools", poolName(), "volumes", pv.Spec.CSI.VolumeHandle, "disk.img")
	got, err := e.readOn(node, disk)
	if err != nil {
		t.Fatalf("the volume of claim %s on %s: %v", claim, node.Name, err)
	}
	if len(got) < len(image) || !bytes.Equal(got[:len(image)], image) {
		t.Fatalf("%s (%d bytes) does not start with the %d bytes of the image", disk, len(got), len(image))
	}
	if len(bytes.Trim(got[len(image):], "\x00")) != 0 {
		t.Errorf("%s has data after the image", disk)
	}
}

// cloneVM is a VM whose root disk is a dataVolumeTemplate "<name>-root"
// cloned from claim source of the test's namespace.
func (n *testNS) cloneVM(name, source string, opts ...vmiOption) *kubevirtv1.VirtualMachine {
	return n.dvTemplateVM(name, &cdiv1.DataVolumeSource{PVC: &cdiv1.DataVolumeSourcePVC{Namespace: n.name, Name: source}},
		"64Mi", kubevirtv1.RunStrategyAlways, opts...)
}
