package capacitypods

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// env is a running controller against the test control plane, in a
// namespace of the test's own.
type env struct {
	ctx  context.Context
	kube kubernetes.Interface
	virt *client.Set
	ns   string
}

// start runs a controller that reads the memory overcommit from mem.
func start(t *testing.T, mem *live.Value[overcommit.Memory]) env {
	t.Helper()
	cp := controlplane.Shared(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	testkit.InstallCRDs(t, cp)
	kube := cp.Clientset(t)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}
	if _, err := kube.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	vmis := virt.VMIs.Informer("", 0, nil)
	c, err := New(Config{Kube: kube, VMIs: vmis, Image: "localhost/pause:test", MemoryOvercommit: mem,
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	go vmis.RunWithContext(ctx)
	go func() { _ = c.Run(ctx) }()
	return env{ctx: ctx, kube: kube, virt: virt, ns: ns}
}

// bound creates vmi in the test's namespace and binds it to node; it
// returns the VMI and, once there, its capacity pod.
func (e env) bound(t *testing.T, vmi *kubevirtv1.VirtualMachineInstance, node string) (*kubevirtv1.VirtualMachineInstance, *corev1.Pod) {
	t.Helper()
	vmi.Namespace = e.ns
	vmi, err := e.virt.VMIs.Create(e.ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	vmi.Status.NodeName, vmi.Status.Phase = node, kubevirtv1.Scheduled
	if vmi, err = e.virt.VMIs.UpdateStatus(e.ctx, vmi); err != nil {
		t.Fatal(err)
	}
	var pod *corev1.Pod
	testkit.Eventually(t, 20*time.Second, "the capacity pod", func() (err error) {
		pod, err = e.kube.CoreV1().Pods(e.ns).Get(e.ctx, PodName(vmi.Name), metav1.GetOptions{})
		return err
	})
	return vmi, pod
}

// A VMI bound to a node gets a pod on that node requesting what the VMI
// takes; the pod goes when the VMI finishes.
func TestPodHoldsBoundVMIsCapacity(t *testing.T) {
	e := start(t, nil)
	ctx, kube, virt, ns := e.ctx, e.kube, e.virt, e.ns
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm"}}
	vmi.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("300Mi")}
	vmi, pod := e.bound(t, vmi, "cap-node-1")
	cpu, mem := scheduler.Requests(vmi, overcommit.Default)
	req := pod.Spec.Containers[0].Resources.Requests
	if pod.Spec.NodeName != "cap-node-1" || req.Memory().Value() != mem || req.Cpu().MilliValue() != cpu || mem != 300<<20 ||
		pod.Labels[scheduler.CapacityPodLabel] != "true" || len(pod.OwnerReferences) != 1 || pod.OwnerReferences[0].UID != vmi.UID {
		t.Errorf("capacity pod %s on %q requests %v labels %v owners %v; want the VMI's node and %dm/%d", pod.Name, pod.Spec.NodeName,
			req, pod.Labels, pod.OwnerReferences, cpu, mem)
	}

	vmi.Status.Phase = kubevirtv1.Succeeded
	if _, err := virt.VMIs.UpdateStatus(ctx, vmi); err != nil {
		t.Fatal(err)
	}
	if err := testkit.Wait(100*time.Millisecond, 20*time.Second, "the capacity pod to go", func() (bool, error) {
		_, err := kube.CoreV1().Pods(ns).Get(ctx, PodName("vm"), metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Errorf("capacity pod of a finished VMI still there: %v", err)
	}

	// A pod of the user's that has a capacity pod's name is never touched.
	mine := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: PodName("other"), Namespace: ns},
		Spec: corev1.PodSpec{NodeName: "elsewhere", Containers: []corev1.Container{{Name: "c", Image: "localhost/mine:1"}}}}
	mine, err := kube.CoreV1().Pods(ns).Create(ctx, mine, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	other := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "other", Namespace: ns}}
	if other, err = virt.VMIs.Create(ctx, other); err != nil {
		t.Fatal(err)
	}
	other.Status.NodeName, other.Status.Phase = "cap-node-1", kubevirtv1.Scheduled
	if _, err := virt.VMIs.UpdateStatus(ctx, other); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // the controller has seen the VMI
	if got, err := kube.CoreV1().Pods(ns).Get(ctx, PodName("other"), metav1.GetOptions{}); err != nil || got.UID != mine.UID {
		t.Errorf("the user's pod %s was replaced or deleted: %v", PodName("other"), err)
	}
}

// A VMI that gives its guest memory and no memory request (one made past
// the webhooks) is held as the brain's scheduler counts it: overcommitted
// by the KubeVirt CR's percentage, not whole.
func TestOvercommittedGuestHeldAsCounted(t *testing.T) {
	over := &live.Value[overcommit.Memory]{}
	over.Set(200)
	e := start(t, over)
	guest := resource.MustParse("256Mi")
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "dense"}}
	vmi.Spec.Domain.Memory = &kubevirtv1.Memory{Guest: &guest}
	vmi, pod := e.bound(t, vmi, "cap-node-2")
	_, mem := scheduler.Requests(vmi, 200)
	if got := pod.Spec.Containers[0].Resources.Requests.Memory().Value(); got != mem || mem != 128<<20 {
		t.Errorf("capacity pod of a 256Mi guest at 200%% requests %d bytes, the scheduler counts %d; want both 128Mi", got, mem)
	}
}
