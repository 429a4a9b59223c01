// Package capacitypods makes VMs visible to kube-scheduler on nodes with a
// kubelet: for every VMI bound to a node and not finished, a pod in the
// VMI's namespace, bound to the same node (spec.nodeName: no scheduler
// decides), requesting the CPU and memory the brain's scheduler counts for
// the VMI (scheduler.Requests: a guest without a memory request counts
// what the KubeVirt CR's memory overcommit makes of it), running only the
// cluster's pause image. kube-scheduler and
// kubelet's admission count it as any pod, so pods are not placed on what
// VMs hold; the brain's scheduler counts the VMI and skips the pod
// (scheduler.CapacityPodLabel). The pod is owned by its VMI (garbage
// collected with it) and deleted when the VMI finishes or moves. A pod
// keeps the requests it was made with: a later overcommit change reaches
// the pods made after it (a VMI's own memory request, which the webhooks
// and the controllers set at creation, never changes). KubeVirt does the
// same: its VMI defaulting turns the overcommit into the VMI's memory
// request at admission, and the virt-launcher pod's resources, rendered
// from that request, are fixed once the pod exists.
//
// When kubelet refuses the pod (pods took the node's memory first), the pod
// ends Failed and a Warning event CapacityConflict names it on the VMI; the
// pod is not made again for that VMI on that node.
//
// Cost: a pause container per running VM, which kubelet and the runtime
// keep (about 15 MiB with containerd's shim): enabled by the brain's
// --capacity-pods, which the cluster manifests set.
package capacitypods

import (
	"context"
	"fmt"
	"log/slog"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
)

// DefaultImage is the pause image of kubeadm clusters of the pinned
// release.
const DefaultImage = "registry.k8s.io/pause:3.10"

// Config configures the controller.
type Config struct {
	Kube kubernetes.Interface
	// VMIs is the shared informer of all VMIs (run by its owner).
	VMIs cache.SharedIndexInformer
	// Image is the pause image the pods run (DefaultImage when empty).
	Image string
	// MemoryOvercommit is the KubeVirt CR's memory overcommit, as the
	// brain's scheduler reads it (nil: no KubeVirt CR).
	MemoryOvercommit *live.Value[overcommit.Memory]
	Log              *slog.Logger
}

// Controller keeps one capacity pod per bound VMI.
type Controller struct {
	cfg   Config
	queue *controller.Queue
}

// New validates cfg and registers with the VMI informer.
func New(cfg Config) (*Controller, error) {
	if cfg.Kube == nil || cfg.VMIs == nil {
		return nil, fmt.Errorf("capacitypods: clients and the VMI informer are required")
	}
	if cfg.Image == "" {
		cfg.Image = DefaultImage
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	c := &Controller{cfg: cfg}
	var err error
	if c.queue, err = controller.New(controller.Config{Name: "capacity-pods", Sync: controller.NoRequeue(c.sync),
		Backoff: controller.BackoffAPI, Log: cfg.Log, KeyAttr: "vmi"}); err != nil {
		return nil, err
	}
	_, err = cfg.VMIs.AddEventHandler(controller.OnChange(c.queue.Enqueue))
	return c, err
}

// Name implements the brain's Role.
func (c *Controller) Name() string { return "capacity-pods" }

// Run works the queue until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	return c.queue.Run(ctx, c.cfg.VMIs.HasSynced)
}

// PodName is the capacity pod's name of a VMI.
func PodName(vmi string) string { return "nodevirt-capacity-" + vmi }

func (c *Controller) sync(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return err
	}
	pods := c.cfg.Kube.CoreV1().Pods(ns)
	obj, exists, err := c.cfg.VMIs.GetStore().GetByKey(key)
	if err != nil {
		return err
	}
	var vmi *kubevirtv1.VirtualMachineInstance
	if exists {
		vmi = obj.(*kubevirtv1.VirtualMachineInstance)
	}
	cur, err := pods.Get(ctx, PodName(name), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		cur = nil
	} else if err != nil {
		return fmt.Errorf("read capacity pod: %w", err)
	}
	if cur != nil && cur.Labels[scheduler.CapacityPodLabel] != "true" {
		// A pod of the user's that happens to have the name: never
		// touched; this VMI's capacity is not held by a pod meanwhile.
		c.cfg.Log.Warn("a pod not made by nodevirt has the capacity pod's name", "namespace", ns, "pod", cur.Name)
		return nil
	}
	wanted := vmi != nil && vmi.DeletionTimestamp == nil && vmi.Status.NodeName != "" && !vmi.IsFinal()
	if cur != nil && (!wanted || cur.Spec.NodeName != vmi.Status.NodeName || cur.Labels["kubevirt.io/created-by"] != string(vmi.UID)) {
		zero := int64(0)
		if err := pods.Delete(ctx, cur.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete capacity pod: %w", err)
		}
		c.cfg.Log.Info("capacity pod removed", "namespace", ns, "vmi", name, "node", cur.Spec.NodeName)
		cur = nil
	}
	if !wanted {
		return nil
	}
	if cur != nil {
		if cur.Status.Phase == corev1.PodFailed && cur.Status.Reason != "" {
			c.cfg.Log.Warn("kubelet refused the capacity pod", "namespace", ns, "vmi", name, "node", cur.Spec.NodeName,
				"reason", cur.Status.Reason, "message", cur.Status.Message)
		}
		return nil
	}
	_, err = pods.Create(ctx, c.podFor(vmi), metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create capacity pod: %w", err)
	}
	c.cfg.Log.Info("capacity pod created", "namespace", ns, "vmi", name, "node", vmi.Status.NodeName)
	return nil
}

func (c *Controller) podFor(vmi *kubevirtv1.VirtualMachineInstance) *corev1.Pod {
	cpu, mem := scheduler.Requests(vmi, c.cfg.MemoryOvercommit.Get())
	no, yes := false, true
	zero := int64(0)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: PodName(vmi.Name), Namespace: vmi.Namespace,
			Labels: map[string]string{scheduler.CapacityPodLabel: "true", "kubevirt.io/created-by": string(vmi.UID)},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: kubevirtv1.SchemeGroupVersion.String(), Kind: "VirtualMachineInstance",
				Name: vmi.Name, UID: vmi.UID, Controller: &yes}}},
		Spec: corev1.PodSpec{
			NodeName:                      vmi.Status.NodeName,
			AutomountServiceAccountToken:  &no,
			EnableServiceLinks:            &no,
			TerminationGracePeriodSeconds: &zero,
			// It holds capacity; it must not be evicted for node conditions
			// its VM does not cause.
			Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			Containers: []corev1.Container{{Name: "capacity", Image: c.cfg.Image, ImagePullPolicy: corev1.PullIfNotPresent,
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceCPU:    *resource.NewMilliQuantity(cpu, resource.DecimalSI),
					corev1.ResourceMemory: *resource.NewQuantity(mem, resource.BinarySI)}},
				SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: &no, ReadOnlyRootFilesystem: &yes,
					RunAsNonRoot: &yes, RunAsUser: ptr(int64(65535)),
					Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}}}},
		},
	}
}

func ptr[T any](v T) *T { return &v }
