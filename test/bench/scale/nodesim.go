package main

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/nodeagent/node"
)

// nodeSim stands in for the node agents of simulated nodes, in this
// process: it registers each Node with nodevirt's labels and a fixed
// capacity, and every heartbeat patches its Ready condition and renews its
// Lease in kube-node-lease, the two writes of nodeagent/node's heartbeat,
// spread evenly over the interval. No agent, libvirt or guest runs: the
// brain sees nodes that stay Ready and VMIs that stay Scheduled.
type nodeSim struct {
	kube      kubernetes.Interface
	names     []string
	heartbeat time.Duration
	capacity  corev1.ResourceList

	// leases holds each node's Lease as last written, so a renewal is one
	// update (the agent reads it first: one GET more, left out here).
	mu     sync.Mutex
	leases map[string]*coordinationv1.Lease
	// last is when each node's previous heartbeat finished.
	last map[string]time.Time

	writes atomic.Int64 // API writes made (node status patches, lease writes)
	failed atomic.Int64 // heartbeats that returned an error
	maxGap atomic.Int64 // longest time between two heartbeats of a node, ns
}

// simCapacity is what each simulated node offers: a large host, and the
// bridge and KVM resources the bench's VMs ask for.
func simCapacity() corev1.ResourceList {
	return corev1.ResourceList{
		corev1.ResourceCPU:             resource.MustParse("128"),
		corev1.ResourceMemory:          resource.MustParse("512Gi"),
		corev1.ResourcePods:            resource.MustParse("110"),
		scheduler.BridgePrefix + "br1": resource.MustParse("1k"),
		scheduler.KVMResource:          resource.MustParse("1k"),
	}
}

func newNodeSim(kube kubernetes.Interface, n int, heartbeat time.Duration) *nodeSim {
	s := &nodeSim{kube: kube, heartbeat: heartbeat, capacity: simCapacity(),
		leases: map[string]*coordinationv1.Lease{}, last: map[string]time.Time{}}
	for i := 0; i < n; i++ {
		s.names = append(s.names, fmt.Sprintf("sim-%04d", i))
	}
	return s
}

// register creates every Node (as an agent does on its first start) and
// gives it a first heartbeat, with workers goroutines.
func (s *nodeSim) register(ctx context.Context, workers int) error {
	return forEach(ctx, len(s.names), workers, func(i int) error {
		name := s.names[i]
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			node.LabelManagedBy: "standalone", node.LabelSchedulable: "true", node.LabelKVM: "true", node.LabelEmulation: "false",
			"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": runtime.GOARCH}}}
		if _, err := s.kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{FieldManager: node.FieldManager}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create node %s: %w", name, err)
		}
		s.writes.Add(1)
		return s.beat(ctx, name)
	})
}

// beat is one heartbeat of a node: its status (capacity, Ready) and its
// Lease, as the agent writes them.
func (s *nodeSim) beat(ctx context.Context, name string) error {
	now := metav1.Now()
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{
		"capacity": s.capacity, "allocatable": s.capacity,
		"conditions": []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "NodeAgentReady",
			Message: "simulated by the scale bench", LastHeartbeatTime: now, LastTransitionTime: now}},
		"addresses": []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: name}},
		"nodeInfo":  corev1.NodeSystemInfo{Architecture: runtime.GOARCH, OperatingSystem: "linux", KubeletVersion: "nodevirt-sim"},
	}})
	if _, err := s.kube.CoreV1().Nodes().Patch(ctx, name, types.StrategicMergePatchType, patch,
		metav1.PatchOptions{FieldManager: node.FieldManager}, "status"); err != nil {
		return fmt.Errorf("node %s status: %w", name, err)
	}
	s.writes.Add(1)
	if err := s.renewLease(ctx, name); err != nil {
		return fmt.Errorf("node %s lease: %w", name, err)
	}
	done := time.Now()
	s.mu.Lock()
	if prev, ok := s.last[name]; ok {
		if gap := int64(done.Sub(prev)); gap > s.maxGap.Load() {
			s.maxGap.Store(gap)
		}
	}
	s.last[name] = done
	s.mu.Unlock()
	return nil
}

func (s *nodeSim) renewLease(ctx context.Context, name string) error {
	leases := s.kube.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	s.mu.Lock()
	l := s.leases[name]
	s.mu.Unlock()
	var err error
	if l == nil {
		holder, secs := name, int32(40)
		l, err = leases.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: &secs, RenewTime: &now}}, metav1.CreateOptions{})
	} else {
		l = l.DeepCopy()
		l.Spec.RenewTime = &now
		l, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	}
	s.writes.Add(1)
	if err != nil {
		// Read it again next time (a conflict, or created elsewhere).
		s.mu.Lock()
		delete(s.leases, name)
		s.mu.Unlock()
		if apierrors.IsAlreadyExists(err) || apierrors.IsConflict(err) {
			got, gerr := leases.Get(ctx, name, metav1.GetOptions{})
			if gerr != nil {
				return gerr
			}
			l = got
		} else {
			return err
		}
	}
	s.mu.Lock()
	s.leases[name] = l
	s.mu.Unlock()
	return nil
}

// run beats every node once per heartbeat until ctx ends, each node on a
// goroutine of its own started heartbeat/len(names) after the previous one,
// as a fleet of agents does: a slow API server delays a node's beats (its
// ticker drops the ticks it misses) without holding up the others'.
func (s *nodeSim) run(ctx context.Context) {
	var wg sync.WaitGroup
	defer wg.Wait()
	step := s.heartbeat / time.Duration(len(s.names))
	for i, name := range s.names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if sleep(ctx, time.Duration(i)*step) != nil {
				return
			}
			t := time.NewTicker(s.heartbeat)
			defer t.Stop()
			for {
				if err := s.beat(ctx, name); err != nil && ctx.Err() == nil {
					s.failed.Add(1)
				}
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		}()
	}
}

// forEach calls f(0..n-1) on workers goroutines and returns the first error.
func forEach(ctx context.Context, n, workers int, f func(i int) error) error {
	next := make(chan int)
	var first error
	var once sync.Once
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := f(i); err != nil {
					once.Do(func() { first = err })
				}
			}
		}()
	}
	for i := 0; i < n && ctx.Err() == nil; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}
