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
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// A VMI bound to a node gets a pod on that node requesting what the VMI
// takes; the pod goes when the VMI finishes.
func TestPodHoldsBoundVMIsCapacity(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
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
	c, err := New(Config{Kube: kube, VMIs: vmis, Image: "localhost/pause:test",
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	go vmis.RunWithContext(ctx)
	go func() { _ = c.Run(ctx) }()

	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: ns}}
	vmi.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("300Mi")}
	vmi, err = virt.VMIs.Create(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	vmi.Status.NodeName, vmi.Status.Phase = "cap-node-1", kubevirtv1.Scheduled
	if vmi, err = virt.VMIs.UpdateStatus(ctx, vmi); err != nil {
		t.Fatal(err)
	}
	var pod *corev1.Pod
	testkit.Eventually(t, 20*time.Second, "the capacity pod", func() (err error) {
		pod, err = kube.CoreV1().Pods(ns).Get(ctx, PodName("vm"), metav1.GetOptions{})
		return err
	})
	cpu, mem := scheduler.Requests(vmi)
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
	if mine, err = kube.CoreV1().Pods(ns).Create(ctx, mine, metav1.CreateOptions{}); err != nil {
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
