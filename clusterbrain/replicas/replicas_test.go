package replicas

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

const examples = "../../../shared/compat/kubevirt-examples/"

// env is a running controller against the test control plane, with a
// kubectl bound to a namespace of the test's own.
type env struct {
	t       *testing.T
	ctx     context.Context
	virt    *client.Set
	kube    kubernetes.Interface
	ns      string
	kubecfg string
}

func start(t *testing.T, opts ...func(*Config)) *env {
	t.Helper()
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	vmis, vms := virt.VMIs.Informer("", 0, nil), virt.VMs.Informer("", 0, nil)
	cfg := Config{Virt: virt, Kube: kube, VMIs: vmis, VMs: vms,
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	for _, o := range opts {
		o(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	go vmis.RunWithContext(ctx)
	go vms.RunWithContext(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	e := &env{t: t, ctx: ctx, virt: virt, kube: kube, ns: cp.Namespace(t), kubecfg: filepath.Join(t.TempDir(), "kubeconfig")}
	if err := cp.WriteKubeconfig(e.kubecfg, "replicas-admin", "system:masters"); err != nil {
		t.Fatal(err)
	}
	return e
}

// kubectl runs kubectl in the test's namespace and returns its output.
func (e *env) kubectl(args ...string) string {
	e.t.Helper()
	bin, err := exec.LookPath("kubectl")
	if err != nil {
		e.t.Fatalf("kubectl is needed: %v", err)
	}
	out, err := exec.CommandContext(e.ctx, bin, append([]string{"--kubeconfig", e.kubecfg, "-n", e.ns}, args...)...).CombinedOutput()
	if err != nil {
		e.t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func (e *env) vmis() []*kubevirtv1.VirtualMachineInstance {
	e.t.Helper()
	l, err := e.virt.VMIs.List(e.ctx, e.ns, metav1.ListOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return slices.DeleteFunc(l, func(v *kubevirtv1.VirtualMachineInstance) bool { return v.DeletionTimestamp != nil })
}

func names[T metav1.Object](l []T) []string {
	var out []string
	for _, o := range l {
		out = append(out, o.GetName())
	}
	slices.Sort(out)
	return out
}

// KubeVirt's replica set example applies unchanged; the controller keeps
// its count through kubectl scale (the scale subresource), prefers to keep
// ready VMIs, replaces finished ones and reports status.
func TestReplicaSetScales(t *testing.T) {
	e := start(t)
	e.kubectl("apply", "-f", examples+"vmi-replicaset-cirros.yaml")
	rs, err := e.virt.VMIReplicaSets.Get(e.ctx, e.ns, "vmi-replicaset-cirros")
	if err != nil {
		t.Fatal(err)
	}
	countIs := func(n int) {
		t.Helper()
		testkit.Eventually(t, 30*time.Second, fmt.Sprintf("%d vmis", n), func() error {
			if got := e.vmis(); len(got) != n {
				return fmt.Errorf("vmis %v", names(got))
			}
			cur, err := e.virt.VMIReplicaSets.Get(e.ctx, e.ns, rs.Name)
			if err != nil {
				return err
			}
			if cur.Status.Replicas != int32(n) {
				return fmt.Errorf("status.replicas %d", cur.Status.Replicas)
			}
			return nil
		})
	}
	countIs(3)
	for _, vmi := range e.vmis() {
		ref := metav1.GetControllerOf(vmi)
		if !strings.HasPrefix(vmi.Name, rs.Name) || ref == nil || ref.UID != rs.UID || ref.Kind != "VirtualMachineInstanceReplicaSet" ||
			vmi.Labels["kubevirt.io/vmReplicaSet"] != rs.Name || vmi.Spec.Domain.Memory == nil || vmi.Spec.Domain.Memory.Guest.String() != "128Mi" {
			t.Errorf("vmi %s: owner %+v labels %v; want %s-prefixed, controlled by the replica set, from its template", vmi.Name, ref, vmi.Labels, rs.Name)
		}
	}
	// One ready VMI: counted, and the one kept on scale down.
	keep := e.vmis()[1]
	keep.Status.Phase = kubevirtv1.Running
	keep.Status.Conditions = []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstanceReady, Status: corev1.ConditionTrue}}
	if _, err := e.virt.VMIs.UpdateStatus(e.ctx, keep); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "readyReplicas 1 and the label selector", func() error {
		cur, err := e.virt.VMIReplicaSets.Get(e.ctx, e.ns, rs.Name)
		if err != nil {
			return err
		}
		if cur.Status.ReadyReplicas != 1 || cur.Status.LabelSelector != "kubevirt.io/vmReplicaSet=vmi-replicaset-cirros" {
			return fmt.Errorf("status %+v", cur.Status)
		}
		return nil
	})
	if out := e.kubectl("get", "vmirs", rs.Name, "--subresource=scale", "-o", "jsonpath={.status.replicas}/{.status.selector}"); out != "3/kubevirt.io/vmReplicaSet=vmi-replicaset-cirros" {
		t.Errorf("scale subresource reads %q", out)
	}

	if out := e.kubectl("get", "vmirs", rs.Name); !strings.Contains(strings.Join(strings.Fields(out), " "), "DESIRED CURRENT READY AGE vmi-replicaset-cirros 3 3 1") {
		t.Errorf("kubectl get vmirs prints %q; want KubeVirt's columns", out)
	}

	e.kubectl("scale", "vmirs/"+rs.Name, "--replicas=1")
	countIs(1)
	if got := names(e.vmis()); got[0] != keep.Name {
		t.Errorf("scale down kept %v, want the ready %s", got, keep.Name)
	}

	e.kubectl("scale", "vmirs/"+rs.Name, "--replicas=2")
	countIs(2)

	// A finished VMI is replaced by a new one.
	failed := e.vmis()[0]
	failed.Status.Phase = kubevirtv1.Failed
	if _, err := e.virt.VMIs.UpdateStatus(e.ctx, failed); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "the failed vmi replaced", func() error {
		got := e.vmis()
		if len(got) != 2 || slices.Contains(names(got), failed.Name) {
			return fmt.Errorf("vmis %v", names(got))
		}
		return nil
	})

	e.kubectl("scale", "vmirs/"+rs.Name, "--replicas=0")
	countIs(0)
}

// KubeVirt's pool example (pool.kubevirt.io/v1beta1) applies unchanged;
// VMs are named <pool>-<index>, scale down removes the highest indexes and
// scale up fills the lowest free ones; v1alpha1 is served too.
func TestPoolScales(t *testing.T) {
	e := start(t)
	e.kubectl("apply", "-f", examples+"vm-pool-cirros.yaml")
	pool, err := e.virt.VMPools.Get(e.ctx, e.ns, "vm-pool-cirros")
	if err != nil {
		t.Fatal(err)
	}
	vmsAre := func(want ...string) {
		t.Helper()
		testkit.Eventually(t, 30*time.Second, fmt.Sprintf("vms %v", want), func() error {
			l, err := e.virt.VMs.List(e.ctx, e.ns, metav1.ListOptions{})
			if err != nil {
				return err
			}
			l = slices.DeleteFunc(l, func(v *kubevirtv1.VirtualMachine) bool { return v.DeletionTimestamp != nil })
			if got := names(l); !slices.Equal(got, want) {
				return fmt.Errorf("vms %v", got)
			}
			cur, err := e.virt.VMPools.Get(e.ctx, e.ns, pool.Name)
			if err != nil {
				return err
			}
			if cur.Status.Replicas != int32(len(want)) || cur.Status.LabelSelector != "kubevirt.io/vmpool=vm-pool-cirros" {
				return fmt.Errorf("status %+v", cur.Status)
			}
			return nil
		})
	}
	vmsAre("vm-pool-cirros-0", "vm-pool-cirros-1", "vm-pool-cirros-2")
	vm, err := e.virt.VMs.Get(e.ctx, e.ns, "vm-pool-cirros-1")
	if err != nil {
		t.Fatal(err)
	}
	if ref := metav1.GetControllerOf(vm); ref == nil || ref.UID != pool.UID || ref.Kind != "VirtualMachinePool" ||
		vm.Labels["kubevirt.io/vmpool"] != pool.Name || vm.Spec.RunStrategy == nil || *vm.Spec.RunStrategy != kubevirtv1.RunStrategyAlways ||
		vm.Spec.Template.ObjectMeta.Labels["kubevirt.io/vmpool"] != pool.Name {
		t.Errorf("vm %s: owner %+v labels %v; want controlled by the pool, from its template", vm.Name, ref, vm.Labels)
	}
	vm.Status.Ready = true
	if _, err := e.virt.VMs.UpdateStatus(e.ctx, vm); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "readyReplicas 1", func() error {
		cur, err := e.virt.VMPools.Get(e.ctx, e.ns, pool.Name)
		if err != nil {
			return err
		}
		if cur.Status.ReadyReplicas != 1 {
			return fmt.Errorf("status %+v", cur.Status)
		}
		return nil
	})

	e.kubectl("scale", "vmpool/"+pool.Name, "--replicas=1")
	vmsAre("vm-pool-cirros-0")
	e.kubectl("scale", "vmpool/"+pool.Name, "--replicas=2")
	vmsAre("vm-pool-cirros-0", "vm-pool-cirros-1")

	if out := e.kubectl("get", "virtualmachinepools.v1alpha1.pool.kubevirt.io", pool.Name, "-o", "jsonpath={.apiVersion} {.spec.replicas}"); out != "pool.kubevirt.io/v1alpha1 2" {
		t.Errorf("v1alpha1 reads %q", out)
	}
}

// KubeVirt's preset example applies unchanged and reads back.
func TestPresetServed(t *testing.T) {
	e := start(t)
	e.kubectl("apply", "-f", examples+"vmi-preset-small.yaml")
	if out := e.kubectl("get", "vmipreset", "vmi-preset-small", "-o", "jsonpath={.spec.domain.memory.guest} {.spec.selector.matchLabels}"); out != `128Mi {"kubevirt.io/vmPreset":"vmi-preset-small"}` {
		t.Errorf("preset reads %q", out)
	}
}
