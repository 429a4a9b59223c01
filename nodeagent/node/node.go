// Package node makes the host a Kubernetes Node. In standalone mode (no
// kubelet) it creates the Node, reports capacity and a Ready condition and
// renews its Lease in kube-node-lease; in cluster mode, where a kubelet owns
// the Node, it only patches nodevirt's labels and extended resources.
package node

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sort"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// Labels nodevirt puts on its nodes.
const (
	LabelSchedulable = "kubevirt.io/schedulable"
	LabelEmulation   = "nodevirt.io/emulation"
	LabelKVM         = "nodevirt.io/kvm"
	LabelManagedBy   = "nodevirt.io/nodeagent"
	FieldManager     = "nodevirt-nodeagent"
)

// Config describes the node.
type Config struct {
	Name string
	// InternalIP is the address published as the Node's InternalIP
	// (see InternalIP); required.
	InternalIP string
	// Emulation reports that guests run under TCG, not KVM.
	Emulation bool
	// Reason explains the KVM/emulation decision.
	Reason string
	// Labels are added to nodevirt's own, e.g. the CSI topology label that
	// kubelet's driver registration would set.
	Labels map[string]string
	// Heartbeat is how often the Lease and Ready condition are renewed.
	Heartbeat time.Duration
	// PeerAnnotation is the Node annotation holding a node agent's
	// address (host:port); Peers lists the other nodes' (none when empty).
	PeerAnnotation string
	Log            *slog.Logger
}

// Registrar keeps the Node object current.
type Registrar struct {
	cfg        Config
	kube       kube.Interface
	standalone bool
	// renewed is when the Lease was last renewed (unix nanoseconds).
	renewed atomic.Int64
	// peers is a watch of the node agents' Nodes, each stripped to its
	// name and address (nil without a PeerAnnotation); Run keeps it.
	peers     cache.Controller
	peerStore cache.Store
}

// LastRenewal is when this agent last renewed its Lease (zero before the
// first renewal, or when a kubelet owns the Node).
func (r *Registrar) LastRenewal() time.Time {
	if ns := r.renewed.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// Peers are the other node agents' addresses as last seen, sorted: from
// a watch of their Nodes, so that finding them costs no List of every Node
// at each heartbeat (a cost that grew with the square of the fleet). The
// addresses stay as last seen when the API server cannot be reached.
func (r *Registrar) Peers() []string {
	if r.peerStore == nil {
		return nil
	}
	var peers []string
	for _, o := range r.peerStore.List() {
		n := o.(*corev1.Node)
		if a := n.Annotations[r.cfg.PeerAnnotation]; a != "" && n.Name != r.cfg.Name {
			peers = append(peers, a)
		}
	}
	sort.Strings(peers)
	return peers
}

// watchPeers makes the watch of the node agents' Nodes behind Peers. Every
// heartbeat of every node still comes through it; the cache keeps of each
// Node only its name and address.
func (r *Registrar) watchPeers() {
	managed := func(o *metav1.ListOptions) { o.LabelSelector = LabelManagedBy }
	r.peerStore, r.peers = cache.NewInformerWithOptions(cache.InformerOptions{
		ListerWatcher: cache.NewFilteredListWatchFromClient(r.kube.CoreV1().RESTClient(), "nodes", metav1.NamespaceAll, managed),
		ObjectType:    &corev1.Node{},
		Handler:       cache.ResourceEventHandlerFuncs{},
		Transform: func(obj any) (any, error) {
			n, ok := obj.(*corev1.Node)
			if !ok {
				return obj, nil // a deleted object's final state unknown
			}
			return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, ResourceVersion: n.ResourceVersion,
				Annotations: map[string]string{r.cfg.PeerAnnotation: n.Annotations[r.cfg.PeerAnnotation]}}}, nil
		},
	})
}

// New returns a Registrar for cfg.
func New(cfg Config, kube kube.Interface) (*Registrar, error) {
	if cfg.Name == "" {
		return nil, fmt.Errorf("node name is required")
	}
	if cfg.InternalIP == "" {
		return nil, fmt.Errorf("node %s: internal ip is required", cfg.Name)
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 10 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	r := &Registrar{cfg: cfg, kube: kube}
	if cfg.PeerAnnotation != "" {
		r.watchPeers()
	}
	return r, nil
}

// Register creates or adopts the Node and returns once it is Ready. It
// tells whether this agent owns the Node (standalone) or a kubelet does.
func (r *Registrar) Register(ctx context.Context) (standalone bool, err error) {
	nodes := r.kube.CoreV1().Nodes()
	existing, err := nodes.Get(ctx, r.cfg.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		r.standalone = true
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: r.cfg.Name, Labels: r.labels()}}
		n.Labels[LabelManagedBy] = "standalone"
		n.Labels["kubernetes.io/hostname"] = r.cfg.Name
		n.Labels["kubernetes.io/os"] = "linux"
		n.Labels["kubernetes.io/arch"] = runtime.GOARCH
		if _, err := nodes.Create(ctx, n, metav1.CreateOptions{FieldManager: FieldManager}); err != nil && !apierrors.IsAlreadyExists(err) {
			return false, fmt.Errorf("create node %s: %w", r.cfg.Name, err)
		}
	case err != nil:
		return false, fmt.Errorf("get node %s: %w", r.cfg.Name, err)
	default:
		r.standalone = existing.Labels[LabelManagedBy] == "standalone"
	}
	if err := r.patchLabels(ctx); err != nil {
		return r.standalone, err
	}
	if r.standalone {
		if err := r.heartbeat(ctx); err != nil {
			return true, err
		}
	}
	return r.standalone, nil
}

// Run renews the heartbeat until ctx ends (standalone mode only).
func (r *Registrar) Run(ctx context.Context) error {
	if !r.standalone {
		<-ctx.Done()
		return nil
	}
	if r.peers != nil {
		go r.peers.RunWithContext(ctx)
	}
	t := time.NewTicker(r.cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if err := r.heartbeat(ctx); err != nil && ctx.Err() == nil {
				r.cfg.Log.Warn("node heartbeat failed", "node", r.cfg.Name, "err", err)
			}
		}
	}
}

func (r *Registrar) labels() map[string]string {
	l := map[string]string{
		LabelSchedulable: "true",
		LabelEmulation:   fmt.Sprint(r.cfg.Emulation),
		LabelKVM:         fmt.Sprint(!r.cfg.Emulation),
	}
	for k, v := range r.cfg.Labels {
		l[k] = v
	}
	return l
}

func (r *Registrar) patchLabels(ctx context.Context) error {
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"labels":      r.labels(),
		"annotations": map[string]string{"nodevirt.io/virtualization": r.cfg.Reason},
	}})
	_, err := r.kube.CoreV1().Nodes().Patch(ctx, r.cfg.Name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: FieldManager})
	if err != nil {
		return fmt.Errorf("label node %s: %w", r.cfg.Name, err)
	}
	return nil
}

// heartbeat writes capacity and the Ready condition and renews the Lease.
func (r *Registrar) heartbeat(ctx context.Context) error {
	capacity := hostCapacity()
	now := metav1.Now()
	status := map[string]any{
		"capacity":    capacity,
		"allocatable": capacity,
		"conditions": []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "NodeAgentReady",
			Message: "nodevirt nodeagent is running", LastHeartbeatTime: now, LastTransitionTime: now,
		}},
		"addresses": []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: r.cfg.Name}, {Type: corev1.NodeInternalIP, Address: r.cfg.InternalIP}},
		"nodeInfo":  corev1.NodeSystemInfo{Architecture: runtime.GOARCH, OperatingSystem: "linux", KubeletVersion: "nodevirt"},
	}
	patch, _ := json.Marshal(map[string]any{"status": status})
	if _, err := r.kube.CoreV1().Nodes().Patch(ctx, r.cfg.Name, types.StrategicMergePatchType, patch,
		metav1.PatchOptions{FieldManager: FieldManager}, "status"); err != nil {
		return fmt.Errorf("node %s status: %w", r.cfg.Name, err)
	}
	if err := r.renewLease(ctx); err != nil {
		return err
	}
	r.renewed.Store(time.Now().UnixNano())
	return nil
}

func (r *Registrar) renewLease(ctx context.Context) error {
	leases := r.kube.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	secs := int32(40)
	lease, err := leases.Get(ctx, r.cfg.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		holder := r.cfg.Name
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: r.cfg.Name},
			Spec:       coordinationv1.LeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: &secs, RenewTime: &now},
		}, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	lease.Spec.RenewTime = &now
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	return err
}

// hostCapacity reads CPUs and memory from the host.
func hostCapacity() corev1.ResourceList {
	rl := corev1.ResourceList{
		corev1.ResourceCPU:  *resource.NewQuantity(int64(runtime.NumCPU()), resource.DecimalSI),
		corev1.ResourcePods: *resource.NewQuantity(110, resource.DecimalSI),
	}
	if mem := memTotal(); mem > 0 {
		rl[corev1.ResourceMemory] = *resource.NewQuantity(mem, resource.BinarySI)
	}
	return rl
}

func memTotal() int64 {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	var kb int64
	if _, err := fmt.Sscanf(string(data), "MemTotal: %d kB", &kb); err != nil {
		return 0
	}
	return kb * 1024
}
