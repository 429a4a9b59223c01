package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/hco"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// applyHyperConverged renders a HyperConverged of spec (JSON) as the hco
// role does and writes its KubeVirt CR into the test's namespace.
func (e env) applyHyperConverged(spec string) {
	e.t.Helper()
	hc := &hcov1beta1.HyperConverged{}
	hc.Name, hc.Namespace = hcov1beta1.Name, e.ns
	if err := json.Unmarshal([]byte(`{"spec":`+spec+`}`), hc); err != nil {
		e.t.Fatal(err)
	}
	hco.SetDefaults(hc)
	c, err := hco.Render(hc, "v0")
	if err != nil {
		e.t.Fatal(err)
	}
	kv := c.KubeVirt
	kv.Namespace, kv.OwnerReferences = e.ns, nil
	ctx := context.Background()
	cur, err := e.virt.KubeVirts.Get(ctx, e.ns, kv.Name)
	if err != nil {
		if _, err := e.virt.KubeVirts.Create(ctx, kv); err != nil {
			e.t.Fatal(err)
		}
		e.t.Cleanup(func() { _ = e.virt.KubeVirts.Delete(context.Background(), e.ns, kv.Name, metav1.DeleteOptions{}) })
		return
	}
	cur.Spec = kv.Spec
	if _, err := e.virt.KubeVirts.Update(ctx, cur); err != nil {
		e.t.Fatal(err)
	}
}

// TestWorkloadsPlacement: the HyperConverged's spec.workloads.nodePlacement,
// rendered into the KubeVirt CR, is where VMIs may run (virt-handler's
// placement): a node outside its selector or affinity, or with a taint its
// tolerations miss (even one the VMI tolerates), takes no VMI and no
// migration; a VMI no node fits waits Unschedulable naming the placement,
// with a FailedScheduling event; a changed placement takes effect for
// waiting VMIs and the next migration.
func TestWorkloadsPlacement(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	dedicated := corev1.Taint{Key: "wp/dedicated", Value: "vm", Effect: corev1.TaintEffectNoSchedule}
	zone := func(z string) map[string]string {
		return map[string]string{"wp/pool": "yes", KVMLabel: "true", "wp/zone": z}
	}
	e.node("wp-a", nodeSpec{cpu: "4", mem: "4Gi", labels: zone("a")})
	e.node("wp-b", nodeSpec{cpu: "4", mem: "4Gi", labels: zone("b")})
	e.node("wp-c", nodeSpec{cpu: "4", mem: "4Gi", labels: zone("a"), taints: []corev1.Taint{dedicated}})
	tolerating := func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.NodeSelector = map[string]string{"wp/pool": "yes"}
		v.Spec.Tolerations = []corev1.Toleration{{Key: dedicated.Key, Operator: corev1.TolerationOpExists}}
	}

	e.applyHyperConverged(`{"workloads": {"nodePlacement": {"nodeSelector": {"wp/zone": "a"}}}}`)
	// The scheduler follows the KubeVirt CR through its informer: wait
	// until a probe pinned to wp-b is refused for the placement.
	probe := func(node string) (string, error) {
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "wp-probe"}}
		v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}
		tolerating(v)
		v.Spec.NodeSelector[corev1.LabelHostname] = node
		return e.sched.Decide(v)
	}
	testkit.Eventually(t, time.Minute, "the scheduler follows the workloads placement", func() error {
		if n, err := probe("wp-b"); err == nil || !strings.Contains(err.Error(), workloadsField) {
			return fmt.Errorf("a VMI pinned to wp-b: node %q, err %v", n, err)
		}
		return nil
	})

	// wp-b is outside the selector; wp-c's taint is tolerated by the VMI
	// but not by the placement: only wp-a is left.
	e.vmi("wp-anywhere", "1Gi", tolerating)
	e.wantNode("wp-anywhere", "wp-a")
	e.vmi("wp-on-b", "1Gi", func(v *kubevirtv1.VirtualMachineInstance) {
		tolerating(v)
		v.Spec.NodeSelector[corev1.LabelHostname] = "wp-b"
	})
	e.wantUnschedulable("wp-on-b", "0/3 nodes are available: 1 didn't match node selector, "+
		"1 spec.workloads.nodePlacement.nodeSelector wp/zone=a does not match, "+
		"1 taint wp/dedicated:NoSchedule not tolerated by spec.workloads.nodePlacement.tolerations.")
	testkit.Eventually(t, time.Minute, "a FailedScheduling event for wp-on-b", func() error {
		evs, err := e.kube.CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=wp-on-b"})
		if err != nil {
			return err
		}
		for _, ev := range evs.Items {
			if ev.Reason == "FailedScheduling" && strings.Contains(ev.Message, workloadsField) {
				return nil
			}
		}
		return fmt.Errorf("events %v", evs.Items)
	})

	// A migration of wp-anywhere off wp-a has no target inside the
	// placement...
	anywhere, err := e.virt.VMIs.Get(ctx, e.ns, "wp-anywhere")
	if err != nil {
		t.Fatal(err)
	}
	migrating := anywhere.DeepCopy()
	migrating.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
		NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
			Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpNotIn, Values: []string{"wp-a"}}}}}}}}
	if target, err := e.sched.DecideMigration(migrating); err == nil || !strings.Contains(err.Error(), workloadsField) {
		t.Errorf("migration target %q (err %v), want none for the workloads placement", target, err)
	}
	e.sched.ReleaseMigration(anywhere.UID)

	// ...until the placement tolerates wp-c's taint: wp-c is then the only
	// one (wp-b still outside the selector).
	e.applyHyperConverged(`{"workloads": {"nodePlacement": {"nodeSelector": {"wp/zone": "a"},
	  "tolerations": [{"key": "wp/dedicated", "operator": "Exists", "effect": "NoSchedule"}]}}}`)
	testkit.Eventually(t, time.Minute, "a migration target inside the new placement", func() error {
		target, err := e.sched.DecideMigration(migrating)
		if err != nil || target != "wp-c" {
			return fmt.Errorf("migration target %q (err %v), want wp-c", target, err)
		}
		return nil
	})
	e.sched.ReleaseMigration(anywhere.UID)

	// A placement by affinity that takes in zone b: the waiting VMI goes.
	e.applyHyperConverged(`{"workloads": {"nodePlacement": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
	  "nodeSelectorTerms": [{"matchExpressions": [{"key": "wp/zone", "operator": "In", "values": ["a", "b"]}]}]}}}}}}`)
	testkit.Poll(t, time.Minute, "wp-on-b bound once the placement takes in zone b", func() (bool, error) {
		v, err := e.virt.VMIs.Get(ctx, e.ns, "wp-on-b")
		if err != nil {
			return false, err
		}
		if v.Status.NodeName != "" && v.Status.NodeName != "wp-b" {
			return false, testkit.Stop(fmt.Errorf("bound to %s", v.Status.NodeName))
		}
		return v.Status.NodeName == "wp-b", nil
	})

	// Without a placement (an empty one, as HCO's default) every node is
	// open again, wp-c to VMIs that tolerate its taint.
	e.applyHyperConverged(`{}`)
	testkit.Eventually(t, time.Minute, "wp-c open to a tolerating VMI without a placement", func() error {
		if n, err := probe("wp-c"); err != nil || n != "wp-c" {
			return fmt.Errorf("a VMI pinned to wp-c: node %q, err %v", n, err)
		}
		return nil
	})
}

// TestMemoryOvercommitCounts: with the HyperConverged's
// higherWorkloadDensity at 200 percent, a VMI that reaches the scheduler
// with its guest memory and no request (as the brain's replica sets create
// them) takes half its guest memory from its node: a 4Gi node holds four
// 2Gi guests, not a fifth.
func TestMemoryOvercommitCounts(t *testing.T) {
	e := setup(t)
	pool := map[string]string{"oc/pool": "yes"}
	e.node("oc-1", nodeSpec{cpu: "8", mem: "4Gi", labels: map[string]string{"oc/pool": "yes", KVMLabel: "true"}})
	guest := func(size string) func(*kubevirtv1.VirtualMachineInstance) {
		return func(v *kubevirtv1.VirtualMachineInstance) {
			q := resource.MustParse(size)
			v.Spec.Domain.Resources.Requests = nil
			v.Spec.Domain.Memory = &kubevirtv1.Memory{Guest: &q}
			v.Spec.NodeSelector = pool
		}
	}
	probe := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "oc-probe"}}
	guest("6Gi")(probe)
	if n, err := e.sched.Decide(probe); err == nil {
		t.Fatalf("a 6Gi guest fits a 4Gi node without overcommit: %s", n)
	}

	e.applyHyperConverged(`{"higherWorkloadDensity": {"memoryOvercommitPercentage": 200}}`)
	testkit.Eventually(t, time.Minute, "the scheduler follows the memory overcommit", func() error {
		if n, err := e.sched.Decide(probe); err != nil || n != "oc-1" {
			return fmt.Errorf("a 6Gi guest at 200%%: node %q, err %v", n, err)
		}
		return nil
	})
	for i := 1; i <= 4; i++ {
		name := fmt.Sprintf("oc-%d", i)
		e.vmi(name, "1Mi", guest("2Gi")) // the request dropped
		e.wantNode(name, "oc-1")
	}
	e.vmi("oc-5", "1Mi", guest("2Gi"))
	if n, msg := e.outcome("oc-5"); n != "" || !strings.Contains(msg, "1 insufficient memory") {
		t.Errorf("a fifth 2Gi guest: node %q, message %q, want insufficient memory", n, msg)
	}
}

// TestPermittedHostDevices: the HyperConverged's permittedHostDevices,
// rendered into the KubeVirt CR, lists the device names VMIs may ask for:
// a VMI naming a GPU or host device it does not list is not scheduled,
// with virt-controller's message; a listed one needs a node whose device
// plugin advertises the resource (one unit per device, as KubeVirt's
// launcher pod requests it) and waits for one, then goes there.
func TestPermittedHostDevices(t *testing.T) {
	e := setup(t)
	e.node("phd-plain", nodeSpec{cpu: "4", mem: "4Gi", labels: map[string]string{KVMLabel: "true", "phd": "yes"}})
	e.applyHyperConverged(`{"permittedHostDevices": {"pciHostDevices": [
	  {"pciDeviceSelector": "10DE:1EB8", "resourceName": "nvidia.com/TU104GL_Tesla_T4"}]}}`)
	const t4 = "nvidia.com/TU104GL_Tesla_T4"
	gpu := func(name string) func(v *kubevirtv1.VirtualMachineInstance) {
		return func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.NodeSelector = map[string]string{"phd": "yes"}
			v.Spec.Domain.Devices.GPUs = []kubevirtv1.GPU{{Name: "gpu1", DeviceName: name}}
		}
	}
	testkit.Eventually(t, time.Minute, "the scheduler follows the permitted host devices", func() error {
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "phd-probe"}}
		gpu("nvidia.com/GP100GL")(v)
		if n, err := e.sched.Decide(v); err == nil || !strings.Contains(err.Error(), "not permitted") {
			return fmt.Errorf("node %q, err %v", n, err)
		}
		return nil
	})

	e.vmi("phd-gp100", "64Mi", gpu("nvidia.com/GP100GL"))
	if node, msg := e.outcome("phd-gp100"); node != "" || !strings.Contains(msg,
		"failed to render launch manifest: GPU nvidia.com/GP100GL is not permitted in permittedHostDevices configuration") {
		t.Errorf("vmi phd-gp100 on %q (%s), want refused for a GPU not permitted", node, msg)
	}
	e.vmi("phd-t4", "64Mi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.NodeSelector = map[string]string{"phd": "yes"}
		v.Spec.Domain.Devices.HostDevices = []kubevirtv1.HostDevice{{Name: "t4", DeviceName: t4}}
	})
	if node, msg := e.outcome("phd-t4"); node != "" || !strings.Contains(msg, "1 lacks "+t4) {
		t.Errorf("vmi phd-t4 on %q (%s), want waiting for a node with %s", node, msg, t4)
	}
	e.node("phd-gpu", nodeSpec{cpu: "4", mem: "4Gi", labels: map[string]string{KVMLabel: "true", "phd": "yes"}, ext: map[string]string{t4: "1"}})
	if node := e.waitBound("phd-t4"); node != "phd-gpu" {
		t.Errorf("vmi phd-t4 on %q, want phd-gpu (the node advertising %s)", node, t4)
	}
}
