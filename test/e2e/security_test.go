package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// pendingVMI asks for a node that does not exist, so it stays Pending (and
// keeps counting against quotas) without touching the host.
func pendingVMI(name, mem string) *kubevirtv1.VirtualMachineInstance {
	q := resource.MustParse(mem)
	return &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": "nowhere"},
			Domain:       kubevirtv1.DomainSpec{Memory: &kubevirtv1.Memory{Guest: &q}},
		}}
}

// hostDiskGatePatch turns KubeVirt's HostDisk gate on through HCO's
// KubeVirt JSON-patch annotation, as upstream documents it.
const hostDiskGatePatch = `[{"op":"add","path":"/spec/configuration/developerConfiguration/featureGates/-","value":"HostDisk"}]`

// The KubeVirt CR advertises only gates nodevirt implements (the suite adds
// HostDisk, as an administrator would). With HostDisk on, the node agent
// still opens hostDisks only under its --host-disk-root, never following a
// symlink: /etc/shadow, a path climbing out of the root and a symlink
// planted in the root fail their VMI with the reason, and no domain is made.
// (Without the gate, admission refuses hostDisks: package admission's
// TestHostDiskNeedsTheFeatureGate, on a real API server.)
func TestHostDiskConfinedOnTheNode(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()

	kv, err := e.virt.KubeVirts.Get(ctx, hcov1beta1.DefaultNamespace, "kubevirt-"+hcov1beta1.Name)
	if err != nil {
		t.Fatal(err)
	}
	gates := kv.Spec.Configuration.DeveloperConfiguration.FeatureGates
	for _, g := range gates {
		if !slices.Contains(featuregate.KubeVirtImplemented, g) {
			t.Errorf("the KubeVirt CR advertises %s, which nodevirt does not implement (gates %v)", g, gates)
		}
	}
	if !featuregate.KubeVirtEnabled(kv, featuregate.HostDisk) {
		t.Fatalf("the suite's HostDisk gate is not on the KubeVirt CR: %v", gates)
	}

	root := e.path("disks")
	planted := filepath.Join(root, n.name, "planted.raw")
	if err := os.MkdirAll(filepath.Dir(planted), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/shadow", planted); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct{ path, want string }{
		"shadow":  {"/etc/shadow", "outside the node's host disk root"},
		"climb":   {root + "/../../../etc/shadow", "outside the node's host disk root"},
		"planted": {planted, "symlink"},
	} {
		vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.name},
			Spec: vmiSpec(c.path)}
		n.createVMI(vmi)
		got := n.waitVMI(name, 60*time.Second, "Failed", func(v *kubevirtv1.VirtualMachineInstance) bool {
			return v.Status.Phase == kubevirtv1.Failed
		})
		if !strings.Contains(vmiConditions(got), c.want) {
			t.Errorf("%s (%s): conditions %s, want one saying %q", name, c.path, vmiConditions(got), c.want)
		}
		if out, err := virsh("dominfo", n.name+"_"+name); err == nil {
			t.Errorf("%s: a domain exists: %s", name, out)
		}
	}
}

// VMIs count against their namespace's ResourceQuota: compute by the
// brain's webhook, the object count by the API server's own quota
// admission; a VM's VMI is refused as a user's is, with the quota's
// message on the VM's events.
func TestResourceQuotaCountsVMIs(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()
	quota := &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Namespace: n.name, Name: "vms"},
		Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{
			corev1.ResourceRequestsMemory:                                    resource.MustParse("200Mi"),
			corev1.ResourceName("count/virtualmachineinstances.kubevirt.io"): resource.MustParse("2"),
		}}}
	if _, err := e.kube.CoreV1().ResourceQuotas(n.name).Create(ctx, quota, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The quota controller fills status.used before the API server's quota
	// admission admits anything under the quota. It counts a custom
	// resource once its discovery (every 30 s) has seen it, and looks at a
	// quota again when its spec changes (or every 5 minutes): the test
	// nudges the quota's spec (an unrelated storage limit) until the VMI
	// count shows.
	count := corev1.ResourceName("count/virtualmachineinstances.kubevirt.io")
	nudge := int64(100)
	n.eventually(90*time.Second, "the quota controller counting VMIs", func() (bool, string) {
		q, err := e.kube.CoreV1().ResourceQuotas(n.name).Get(ctx, "vms", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if _, ok := q.Status.Used[count]; ok {
			return true, ""
		}
		nudge++
		q.Spec.Hard[corev1.ResourceRequestsStorage] = *resource.NewQuantity(nudge<<30, resource.BinarySI)
		_, _ = e.kube.CoreV1().ResourceQuotas(n.name).Update(ctx, q, metav1.UpdateOptions{})
		time.Sleep(2 * time.Second)
		return false, fmt.Sprintf("status %+v", q.Status)
	})

	var last error
	n.eventually(30*time.Second, "first vmi admitted", func() (bool, string) {
		v := pendingVMI("a", "128Mi")
		v.Namespace = n.name
		_, last = e.virt.VMIs.Create(ctx, v)
		return last == nil, fmt.Sprint(last)
	})
	b := pendingVMI("b", "128Mi")
	b.Namespace = n.name
	_, err := e.virt.VMIs.Create(ctx, b)
	if err == nil || !strings.Contains(err.Error(), "exceeded quota: vms, requested: requests.memory=128Mi, used: requests.memory=128Mi, limited: requests.memory=200Mi") {
		t.Fatalf("second vmi over the memory quota: %v", err)
	}
	small := pendingVMI("small", "64Mi")
	small.Namespace = n.name
	n.createVMI(small)
	tiny := pendingVMI("tiny", "1Mi")
	tiny.Namespace = n.name
	_, err = e.virt.VMIs.Create(ctx, tiny)
	if err == nil || !strings.Contains(err.Error(), "exceeded quota: vms, requested: count/virtualmachineinstances.kubevirt.io=1, used: count/virtualmachineinstances.kubevirt.io=2, limited: count/virtualmachineinstances.kubevirt.io=2") {
		t.Fatalf("third vmi over the count quota: %v", err)
	}

	// The brain's own VMI creates (a VM started) meet the same quota.
	always := kubevirtv1.RunStrategyAlways
	spec := pendingVMI("", "128Mi").Spec
	n.createVM(&kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: n.name, Name: "over"},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &always, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: spec}}})
	n.eventually(60*time.Second, "the VM's FailedCreate event naming the quota", func() (bool, string) {
		evs, err := e.kube.CoreV1().Events(n.name).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=over"})
		if err != nil {
			return false, err.Error()
		}
		var seen []string
		for _, ev := range evs.Items {
			if ev.Reason == "FailedCreate" && strings.Contains(ev.Message, "exceeded quota: vms") {
				return true, ""
			}
			seen = append(seen, ev.Reason+": "+ev.Message)
		}
		return false, strings.Join(seen, "; ")
	})
	if _, err := n.getVMI("over"); err == nil {
		t.Error("the VM's VMI exists past the quota")
	}
}

// A user cannot bind a VMI to a node (the label the node agents select
// their VMIs by), nor change a VMI's spec.
func TestUsersCannotRebindVMIs(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()
	pinned := pendingVMI("pinned", "64Mi")
	pinned.Namespace = n.name
	pinned.Labels = map[string]string{kubevirtv1.NodeNameLabel: e.nodeName}
	if _, err := e.virt.VMIs.Create(ctx, pinned); err == nil || !strings.Contains(err.Error(), "creation of the following reserved kubevirt.io/ labels") {
		t.Errorf("vmi created bound to a node: %v", err)
	}
	v := pendingVMI("loose", "64Mi")
	v.Namespace = n.name
	n.createVMI(v)
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, kubevirtv1.NodeNameLabel, e.nodeName)
	if _, err := e.virt.VMIs.Patch(ctx, n.name, "loose", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err == nil ||
		!strings.Contains(err.Error(), "modification of the following reserved kubevirt.io/ labels") {
		t.Errorf("vmi bound to a node by its user: %v", err)
	}
	if _, err := e.virt.VMIs.Patch(ctx, n.name, "loose", types.MergePatchType, []byte(`{"spec":{"nodeSelector":null}}`), metav1.PatchOptions{}); err == nil ||
		!strings.Contains(err.Error(), "update of VMI object is restricted") {
		t.Errorf("vmi spec changed by its user: %v", err)
	}
}
