package scheduler

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
)

// Pods share nodes with VMs where a kubelet runs: a node's CPU and memory
// taken by its pods' requests are not free for VMs. The scheduler watches
// the pods bound to nodes that have not ended, each stripped to its node
// and requests as it enters the cache, and counts them in every node's
// state (snapshot) as kube-scheduler does: per pod the larger of the sum of
// its containers' requests and its largest init container's, plus its
// overhead.

// podFieldSelector keeps the pods that hold capacity: bound, not ended.
const podFieldSelector = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"

// podInformer registers the stripped pod informer with the factory.
func podInformer(f informers.SharedInformerFactory) cache.SharedIndexInformer {
	inf := f.InformerFor(&corev1.Pod{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return coreinformers.NewFilteredPodInformer(c, metav1.NamespaceAll, resync, cache.Indexers{nodeIndex: podNode},
			func(o *metav1.ListOptions) { o.FieldSelector, o.LabelSelector = podFieldSelector, "!"+CapacityPodLabel })
	})
	_ = inf.SetTransform(stripPod)
	return inf
}

func podNode(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Spec.NodeName == "" {
		return nil, nil
	}
	return []string{p.Spec.NodeName}, nil
}

// stripPod keeps what placement reads: identity, node, requests.
func stripPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	keep := func(cs []corev1.Container) []corev1.Container {
		out := make([]corev1.Container, len(cs))
		for i, c := range cs {
			out[i] = corev1.Container{Name: c.Name, Resources: corev1.ResourceRequirements{Requests: c.Resources.Requests}}
		}
		return out
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion},
		Spec: corev1.PodSpec{NodeName: p.Spec.NodeName, Containers: keep(p.Spec.Containers),
			InitContainers: keep(p.Spec.InitContainers), Overhead: p.Spec.Overhead},
		Status: corev1.PodStatus{Phase: p.Status.Phase},
	}, nil
}

// podRequests is what a pod holds on its node, as kube-scheduler counts it.
func podRequests(p *corev1.Pod) (cpu, mem int64) {
	for _, c := range p.Spec.Containers {
		cpu += c.Resources.Requests.Cpu().MilliValue()
		mem += c.Resources.Requests.Memory().Value()
	}
	for _, c := range p.Spec.InitContainers {
		cpu = max(cpu, c.Resources.Requests.Cpu().MilliValue())
		mem = max(mem, c.Resources.Requests.Memory().Value())
	}
	cpu += p.Spec.Overhead.Cpu().MilliValue()
	mem += p.Spec.Overhead.Memory().Value()
	return cpu, mem
}

// addPods counts the pods bound to st's node.
func (s *Scheduler) addPods(st *nodeState) {
	objs, _ := s.pods.GetIndexer().ByIndex(nodeIndex, st.node.Name)
	for _, o := range objs {
		p := o.(*corev1.Pod)
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		cpu, mem := podRequests(p)
		st.cpu += cpu
		st.mem += mem
	}
}

// CapacityPodLabel marks the pods that hold a VMI's capacity for
// kube-scheduler (package capacitypods); the scheduler counts their VMIs,
// never the pods themselves.
const CapacityPodLabel = "nodevirt.io/vmi-capacity"

// Requests is the CPU (millicores) and memory (bytes) a VMI takes from its
// node, as the scheduler counts it with the memory overcommit over (a
// guest without a memory request counted overcommitted; see demandOf).
func Requests(vmi *kubevirtv1.VirtualMachineInstance, over overcommit.Memory) (cpu, mem int64) {
	d, _ := demandOf(vmi, over, func(string, string) (string, error) { return "", nil })
	return d.cpu, d.mem
}
