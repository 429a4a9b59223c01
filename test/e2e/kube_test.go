package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// testNS is a namespace that belongs to one test, with the host bridges the
// test made; its cleanup deletes the test's VMs and VMIs, waits until
// nodevirt has removed their domains, then deletes the bridges.
type testNS struct {
	e       *env
	t       *testing.T
	name    string
	bridges []string
}

var nonDNS = regexp.MustCompile(`[^a-z0-9-]+`)

// namespace creates the test's namespace, named after the test.
func (e *env) namespace(t *testing.T) *testNS {
	t.Helper()
	base := strings.Trim(nonDNS.ReplaceAllString(strings.ToLower(strings.TrimPrefix(t.Name(), "Test")), "-"), "-")
	name := "e2e-" + e.run + "-" + base
	if len(name) > 50 {
		name = strings.TrimRight(name[:50], "-")
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"nodevirt.io/e2e": e.run}}}
	if _, err := e.kube.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", name, err)
	}
	n := &testNS{e: e, t: t, name: name}
	t.Cleanup(n.cleanup)
	return n
}

func (n *testNS) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if err := n.e.emptyNamespace(ctx, n.name); err != nil {
		n.t.Errorf("cleanup: %v", err)
	}
	_ = n.e.kube.CoreV1().Namespaces().Delete(ctx, n.name, metav1.DeleteOptions{})
	for _, br := range n.bridges {
		taps, err := deleteBridge(br)
		if err != nil {
			n.t.Errorf("cleanup: %v", err)
		}
		if len(taps) > 0 {
			n.t.Errorf("cleanup: taps %v were still on bridge %s after their VMIs were gone (nodeagent did not detach them)", taps, br)
		}
	}
	if n.t.Failed() {
		for _, d := range []*daemon{n.e.agent, n.e.brain} {
			if lines := tailFile(d.logPath, 25, n.name); lines != "" {
				n.t.Logf("%s log lines about %s:\n%s", d.name, n.name, lines)
			}
		}
	}
}

// emptyNamespace deletes the VMs and VMIs of a namespace and waits until the
// VMIs and their domains are gone. What nodevirt does not remove in time is
// reported, then removed by force (finalizers dropped, domains destroyed).
func (e *env) emptyNamespace(ctx context.Context, ns string) error {
	vms, err := e.virt.VMs.List(ctx, ns, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list vms in %s: %w", ns, err)
	}
	for _, vm := range vms {
		_ = e.virt.VMs.Delete(ctx, ns, vm.Name, metav1.DeleteOptions{})
	}
	vmis, err := e.virt.VMIs.List(ctx, ns, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list vmis in %s: %w", ns, err)
	}
	for _, vmi := range vmis {
		_ = e.virt.VMIs.Delete(ctx, ns, vmi.Name, metav1.DeleteOptions{})
	}
	var left []string
	for {
		left = left[:0]
		vmis, err := e.virt.VMIs.List(ctx, ns, metav1.ListOptions{})
		if err == nil {
			for _, vmi := range vmis {
				left = append(left, fmt.Sprintf("vmi %s (phase %s, finalizers %v)", vmi.Name, vmi.Status.Phase, vmi.Finalizers))
			}
		}
		if out, err := virsh("list", "--all", "--name"); err == nil {
			for _, d := range strings.Fields(out) {
				if strings.HasPrefix(d, ns+"_") {
					left = append(left, "domain "+d)
				}
			}
		}
		if len(left) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			e.forceEmpty(ns)
			return fmt.Errorf("namespace %s: still present after deletion (removed by force): %s", ns, strings.Join(left, "; "))
		case <-time.After(300 * time.Millisecond):
		}
	}
}

func (e *env) forceEmpty(ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	vmis, _ := e.virt.VMIs.List(ctx, ns, metav1.ListOptions{})
	for _, vmi := range vmis {
		patch := []byte(`{"metadata":{"finalizers":null}}`)
		_, _ = e.virt.VMIs.Patch(ctx, ns, vmi.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	}
	if out, err := virsh("list", "--all", "--name"); err == nil {
		for _, d := range strings.Fields(out) {
			if strings.HasPrefix(d, ns+"_") {
				_, _ = virsh("destroy", d)
				_, _ = virsh("undefine", "--nvram", d)
			}
		}
	}
}

// bridgeNetwork creates a host bridge and a NetworkAttachmentDefinition of
// type cnv-bridge on it, as a user would for KubeVirt's bridge binding.
func (n *testNS) bridgeNetwork(name string) (nad, bridge string) {
	n.t.Helper()
	br, err := n.e.newBridge()
	if err != nil {
		n.t.Fatal(err)
	}
	n.bridges = append(n.bridges, br)
	conf, _ := json.Marshal(map[string]any{"cniVersion": "0.3.1", "name": name, "type": "cnv-bridge", "bridge": br, "macspoofchk": true})
	obj := &nadv1.NetworkAttachmentDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.name, Annotations: map[string]string{
			"k8s.v1.cni.cncf.io/resourceName": "bridge.network.kubevirt.io/" + br}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: string(conf)},
	}
	if _, err := n.e.virt.NADs.Create(context.Background(), obj); err != nil {
		n.t.Fatalf("create NetworkAttachmentDefinition %s/%s: %v", n.name, name, err)
	}
	return name, br
}

// createVMI creates a VMI, failing the test with the API's answer.
func (n *testNS) createVMI(vmi *kubevirtv1.VirtualMachineInstance) *kubevirtv1.VirtualMachineInstance {
	n.t.Helper()
	out, err := n.e.virt.VMIs.Create(context.Background(), vmi)
	if err != nil {
		n.t.Fatalf("create vmi %s/%s: %v", n.name, vmi.Name, err)
	}
	return out
}

func (n *testNS) createVM(vm *kubevirtv1.VirtualMachine) *kubevirtv1.VirtualMachine {
	n.t.Helper()
	out, err := n.e.virt.VMs.Create(context.Background(), vm)
	if err != nil {
		n.t.Fatalf("create vm %s/%s: %v", n.name, vm.Name, err)
	}
	return out
}

func (n *testNS) getVMI(name string) (*kubevirtv1.VirtualMachineInstance, error) {
	return n.e.virt.VMIs.Get(context.Background(), n.name, name)
}

func (n *testNS) getVM(name string) (*kubevirtv1.VirtualMachine, error) {
	return n.e.virt.VMs.Get(context.Background(), n.name, name)
}

// setRunStrategy changes a VM's runStrategy, as `virtctl start/stop` ends up
// doing.
func (n *testNS) setRunStrategy(name string, rs kubevirtv1.VirtualMachineRunStrategy) {
	n.t.Helper()
	patch := fmt.Sprintf(`{"spec":{"runStrategy":%q}}`, rs)
	if _, err := n.e.virt.VMs.Patch(context.Background(), n.name, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		n.t.Fatalf("set runStrategy %s on vm %s/%s: %v", rs, n.name, name, err)
	}
}

// eventually polls cond until it holds or timeout passes; on timeout the
// test fails with what and cond's last explanation. Conditions here ask
// the cluster, often diagnose it: every 250 ms.
func (n *testNS) eventually(timeout time.Duration, what string, cond func() (bool, string)) {
	n.t.Helper()
	testkit.PollEvery(n.t, 250*time.Millisecond, timeout, what, func() (bool, error) {
		ok, why := cond()
		return ok, errors.New(why)
	})
}

// waitNodeReady waits up to 2 minutes until the Node is Ready.
func (n *testNS) waitNodeReady(name string) {
	n.t.Helper()
	n.eventually(2*time.Minute, "node "+name+" Ready", func() (bool, string) {
		node, err := n.e.kube.CoreV1().Nodes().Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && nodeReady(node), fmt.Sprint("not Ready ", err)
	})
}

// waitVMI waits until the VMI satisfies ok and returns it; on timeout the
// failure names the component whose step did not happen.
func (n *testNS) waitVMI(name string, timeout time.Duration, what string, ok func(*kubevirtv1.VirtualMachineInstance) bool) *kubevirtv1.VirtualMachineInstance {
	n.t.Helper()
	var last *kubevirtv1.VirtualMachineInstance
	n.eventually(timeout, fmt.Sprintf("vmi %s/%s %s", n.name, name, what), func() (bool, string) {
		vmi, err := n.getVMI(name)
		if err != nil {
			return false, n.diagnoseVMI(name, nil, err)
		}
		last = vmi
		if ok(vmi) {
			return true, ""
		}
		return false, n.diagnoseVMI(name, vmi, nil)
	})
	return last
}

// waitRunning waits until the VMI is placed on a node (a quick step: it
// fails fast when nothing places it), then until it runs.
func (n *testNS) waitRunning(name string) *kubevirtv1.VirtualMachineInstance {
	n.t.Helper()
	n.waitVMI(name, 45*time.Second, "placed on a node", func(v *kubevirtv1.VirtualMachineInstance) bool {
		return v.Status.NodeName != ""
	})
	return n.waitVMI(name, 2*time.Minute, "Running", func(v *kubevirtv1.VirtualMachineInstance) bool {
		return v.Status.Phase == kubevirtv1.Running
	})
}

// waitGone waits until the VMI no longer exists and its domain is gone from
// libvirt, and returns every phase it was seen in meanwhile.
func (n *testNS) waitGone(name string, timeout time.Duration) []kubevirtv1.VirtualMachineInstancePhase {
	n.t.Helper()
	var phases []kubevirtv1.VirtualMachineInstancePhase
	n.eventually(timeout, fmt.Sprintf("vmi %s/%s and its domain gone", n.name, name), func() (bool, string) {
		vmi, err := n.getVMI(name)
		if err == nil {
			if len(phases) == 0 || phases[len(phases)-1] != vmi.Status.Phase {
				phases = append(phases, vmi.Status.Phase)
			}
			return false, fmt.Sprintf("vmi still exists (phases seen %v, deletionTimestamp %v, finalizers %v); domain state %q",
				phases, vmi.DeletionTimestamp, vmi.Finalizers, domainState(n.name, name))
		}
		if !apierrors.IsNotFound(err) {
			return false, err.Error()
		}
		if st := domainState(n.name, name); st != "" {
			return false, fmt.Sprintf("vmi deleted but domain %s is still defined (%s): nodeagent/handler did not undefine it", domainName(n.name, name), st)
		}
		return true, ""
	})
	return phases
}

// diagnoseVMI explains where a VMI is stuck, naming the component whose
// step is missing.
func (n *testNS) diagnoseVMI(name string, vmi *kubevirtv1.VirtualMachineInstance, err error) string {
	if vmi == nil && err == nil {
		vmi, err = n.getVMI(name)
	}
	if err != nil {
		if apierrors.IsNotFound(err) {
			return "the vmi does not exist"
		}
		return err.Error()
	}
	st := domainState(n.name, name)
	conds := vmiConditions(vmi)
	switch {
	case vmi.Status.NodeName == "" && (vmi.Status.Phase == "" || vmi.Status.Phase == kubevirtv1.Pending):
		return fmt.Sprintf("phase %q and no status.nodeName: the scheduler (clusterbrain/scheduler) did not place it%s", vmi.Status.Phase, conds)
	case vmi.Status.Phase == kubevirtv1.Scheduling || vmi.Status.Phase == kubevirtv1.Scheduled || vmi.Status.Phase == kubevirtv1.Pending:
		return fmt.Sprintf("phase %s on node %s, libvirt domain state %q: the node agent (nodeagent/handler) did not start it%s",
			vmi.Status.Phase, vmi.Status.NodeName, st, conds)
	case vmi.Status.Phase == kubevirtv1.Failed:
		return fmt.Sprintf("phase Failed (reason %q) on node %s, domain state %q%s", vmi.Status.Reason, vmi.Status.NodeName, st, conds)
	default:
		return fmt.Sprintf("phase %s on node %s, domain state %q%s", vmi.Status.Phase, vmi.Status.NodeName, st, conds)
	}
}

func vmiConditions(vmi *kubevirtv1.VirtualMachineInstance) string {
	var parts []string
	for _, c := range vmi.Status.Conditions {
		s := fmt.Sprintf("%s=%s", c.Type, c.Status)
		if c.Reason != "" || c.Message != "" {
			s += fmt.Sprintf(" (%s: %s)", c.Reason, c.Message)
		}
		parts = append(parts, s)
	}
	if len(parts) == 0 {
		return ""
	}
	return "; conditions: " + strings.Join(parts, ", ")
}

func hasCondition(vmi *kubevirtv1.VirtualMachineInstance, typ kubevirtv1.VirtualMachineInstanceConditionType) bool {
	return slices.ContainsFunc(vmi.Status.Conditions, func(c kubevirtv1.VirtualMachineInstanceCondition) bool {
		return c.Type == typ && c.Status == corev1.ConditionTrue
	})
}

// waitVMIOfVM waits until the VM's VMI runs and is not one of the given
// UIDs, and returns it.
func (n *testNS) waitVMIOfVM(vm string, timeout time.Duration, notUIDs ...types.UID) *kubevirtv1.VirtualMachineInstance {
	n.t.Helper()
	var out *kubevirtv1.VirtualMachineInstance
	n.eventually(time.Minute, fmt.Sprintf("vm %s/%s has a new vmi", n.name, vm), func() (bool, string) {
		vmi, err := n.getVMI(vm)
		if err != nil {
			return false, n.diagnoseVM(vm, err)
		}
		if slices.Contains(notUIDs, vmi.UID) {
			return false, fmt.Sprintf("the VMI is still the old one (uid %s, phase %s): clusterbrain/vmcontroller did not replace it; %s",
				vmi.UID, vmi.Status.Phase, n.diagnoseVM(vm, nil))
		}
		return true, ""
	})
	n.eventually(45*time.Second, fmt.Sprintf("vm %s/%s: new vmi placed on a node", n.name, vm), func() (bool, string) {
		vmi, err := n.getVMI(vm)
		if err != nil {
			return false, n.diagnoseVM(vm, err)
		}
		return vmi.Status.NodeName != "" || slices.Contains(notUIDs, vmi.UID), n.diagnoseVMI(vm, vmi, nil)
	})
	n.eventually(timeout, fmt.Sprintf("vm %s/%s running a new vmi", n.name, vm), func() (bool, string) {
		vmi, err := n.getVMI(vm)
		if err != nil {
			return false, n.diagnoseVM(vm, err)
		}
		if slices.Contains(notUIDs, vmi.UID) {
			return false, fmt.Sprintf("the VMI is still the old one (uid %s, phase %s): clusterbrain/vmcontroller did not replace it; %s",
				vmi.UID, vmi.Status.Phase, n.diagnoseVM(vm, nil))
		}
		if vmi.Status.Phase != kubevirtv1.Running {
			return false, n.diagnoseVMI(vm, vmi, nil)
		}
		out = vmi
		return true, ""
	})
	return out
}

// diagnoseVM explains a VM without (the expected) VMI.
func (n *testNS) diagnoseVM(name string, vmiErr error) string {
	vm, err := n.getVM(name)
	if err != nil {
		return "vm: " + err.Error()
	}
	var conds []string
	for _, c := range vm.Status.Conditions {
		conds = append(conds, fmt.Sprintf("%s=%s (%s: %s)", c.Type, c.Status, c.Reason, c.Message))
	}
	s := fmt.Sprintf("vm printableStatus %q, created %v, ready %v, conditions [%s]", vm.Status.PrintableStatus, vm.Status.Created, vm.Status.Ready, strings.Join(conds, ", "))
	if vmiErr != nil && apierrors.IsNotFound(vmiErr) {
		s = "no VMI: clusterbrain/vmcontroller did not create it; " + s
	} else if vmiErr != nil {
		s = vmiErr.Error() + "; " + s
	}
	return s
}

// deleteVMI deletes a VMI with the given options.
func (n *testNS) deleteVMI(name string, gracePeriod *int64) {
	n.t.Helper()
	opts := metav1.DeleteOptions{GracePeriodSeconds: gracePeriod}
	err := n.e.virt.VMIs.Delete(context.Background(), n.name, name, opts)
	if err != nil && !apierrors.IsNotFound(err) {
		n.t.Fatalf("delete vmi %s/%s: %v", n.name, name, err)
	}
}

// interfaceMAC returns the MAC of the VMI's first interface as its status
// reports it, falling back to the spec (set by the MAC pool at admission).
func interfaceMAC(vmi *kubevirtv1.VirtualMachineInstance) (status, spec string) {
	if len(vmi.Status.Interfaces) > 0 {
		status = vmi.Status.Interfaces[0].MAC
	}
	if len(vmi.Spec.Domain.Devices.Interfaces) > 0 {
		spec = vmi.Spec.Domain.Devices.Interfaces[0].MacAddress
	}
	return status, spec
}
