package scheduler

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// A pod bound to a node (a kubelet's) holds the memory it requested: a
// VMI that would need it stays unschedulable, and is placed once the pod
// is gone.
func TestPodsHoldTheirNodesCapacity(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	e.node("pods-1", nodeSpec{cpu: "4", mem: "1Gi"})
	// The ServiceAccount admission plugin wants the namespace's default
	// account (no controller manager runs here to make it).
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: e.ns}}
	if _, err := e.kube.CoreV1().ServiceAccounts(e.ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "holder", Namespace: e.ns},
		Spec: corev1.PodSpec{NodeName: "pods-1", Containers: []corev1.Container{{Name: "c", Image: "localhost/holder:1",
			Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("600Mi")}}}},
			InitContainers: []corev1.Container{{Name: "init", Image: "localhost/holder:1",
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("800Mi")}}}}}}
	if _, err := e.kube.CoreV1().Pods(e.ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	onPodsNode := func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": "pods-1"}
	}
	// 1 Gi - max(600 Mi, init 800 Mi) leaves 224 Mi.
	e.vmi("beside-pod", "256Mi", onPodsNode)
	if node, msg := e.outcome("beside-pod"); node != "" || !strings.Contains(msg, "insufficient memory") {
		t.Errorf("VMI beside an 800 Mi pod on a 1 Gi node: node %q, message %q", node, msg)
	}
	e.vmi("small-beside-pod", "128Mi", onPodsNode)
	e.wantNode("small-beside-pod", "pods-1")

	zero := int64(0)
	if err := e.kube.CoreV1().Pods(e.ns).Delete(ctx, "holder", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	if node := e.waitBound("beside-pod"); node != "pods-1" {
		t.Errorf("after the pod went: on %q", node)
	}
}

func TestPodRequestsCountsLikeKubeScheduler(t *testing.T) {
	q := resource.MustParse
	p := &corev1.Pod{Spec: corev1.PodSpec{
		Containers: []corev1.Container{
			{Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: q("100m"), corev1.ResourceMemory: q("100Mi")}}},
			{Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: q("200m"), corev1.ResourceMemory: q("50Mi")}}},
		},
		InitContainers: []corev1.Container{
			{Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: q("1"), corev1.ResourceMemory: q("10Mi")}}},
		},
		Overhead: corev1.ResourceList{corev1.ResourceCPU: q("10m"), corev1.ResourceMemory: q("1Mi")},
	}}
	cpu, mem := podRequests(p)
	if cpu != 1010 || mem != 151<<20 {
		t.Errorf("cpu %dm mem %d, want 1010m and 151 Mi", cpu, mem)
	}
}
