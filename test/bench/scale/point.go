package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/bench/measure"
)

// point is what one (nodes, VMs) run measured.
type point struct {
	Nodes, VMs int
	// Placed is how many VMIs were bound to a node when the wait ended.
	Placed int
	// Create is how long the bench took to create every VM (each through
	// the brain's webhooks); Place from the first create until every VMI
	// was bound.
	Create, Place time.Duration
	// Refused counts the creations the API server refused (each tried
	// again, up to twice).
	Refused int64
	// BrainCPU is the brain's CPU time from the first create until the
	// settle period after the last binding ended; APICPU and EtcdCPU the
	// control plane's over the same span.
	BrainCPU, APICPU, EtcdCPU time.Duration
	// PeakRSS is the brain's VmHWM, IdleRSS its VmRSS with every VMI
	// present and settled, BaseRSS its VmRSS before the burst.
	PeakRSS, IdleRSS, BaseRSS float64
	// Writes is the API writes over the same span as BrainCPU, less the
	// simulator's heartbeats; Requests their breakdown.
	Writes   float64
	Requests []measure.Count
	// Latencies are the API server's mean latencies per webhook and
	// request kind over the same span, as text.
	Latencies string
	// IdleBefore and IdleAfter are the brain's CPU use (fraction of a
	// core) over the idle window with no VM and with every VMI placed.
	IdleBefore, IdleAfter float64
	// BeatsBefore and BeatsAfter are the simulated nodes' heartbeats per
	// second over the same windows (nodes / heartbeat period asked; a
	// loaded machine delays them, and the brain's idle work with them).
	BeatsBefore, BeatsAfter float64
	// NotReady counts the nodes not Ready or tainted after the run; SimGap
	// is the longest a simulated node went between heartbeats during the
	// burst and idle window.
	NotReady int
	SimGap   time.Duration
	// SimFailed counts the heartbeats the API server refused.
	SimFailed int64
	// LoadBefore and LoadAfter are the machine's 1-minute load average.
	LoadBefore, LoadAfter string
}

// PlacePerVM is the placement time per VM.
func (p point) PlacePerVM() time.Duration { return p.Place / time.Duration(p.VMs) }

// CPUPerVM is the brain's CPU time per VM.
func (p point) CPUPerVM() time.Duration { return p.BrainCPU / time.Duration(p.VMs) }

// timing is how long each phase of a point waits.
type timing struct {
	settle, idle time.Duration
}

// run measures one point on a started cluster: the idle brain, the burst of
// nVMs VM creations until every VMI is bound, then the idle brain with all
// of them.
func (c *cluster) run(ctx context.Context, nVMs int, t timing) (point, error) {
	p := point{Nodes: len(c.sim.names), VMs: nVMs, LoadBefore: loadavg()}
	pid := c.brain.Process.Pid
	// The brain's start-up work (the HyperConverged's children, common
	// templates, the nodes' first leases) is over before the idle window.
	if err := c.settle(ctx, t.settle); err != nil {
		return p, err
	}
	var err error
	if p.IdleBefore, p.BeatsBefore, err = c.idleCPU(ctx, t.idle); err != nil {
		return p, err
	}
	// Shown now: a burst that fails (a loaded machine) still leaves it.
	fmt.Fprintf(os.Stderr, "    idle brain, no VM: %.2f%% of a core over %s, %.1f node heartbeats/s (%.0f µs of brain CPU each)\n",
		100*p.IdleBefore, t.idle, p.BeatsBefore, 1e6*p.IdleBefore/p.BeatsBefore)
	p.BaseRSS = measure.MemMiB(pid, "VmRSS")

	// Bindings are seen through a watch started before the burst.
	var mu sync.Mutex
	bound := map[string]*kubevirtv1.VirtualMachineInstance{}
	all := make(chan struct{})
	onVMI := func(obj any) {
		v, ok := obj.(*kubevirtv1.VirtualMachineInstance)
		if !ok || v.Status.NodeName == "" {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if _, seen := bound[v.Name]; !seen {
			bound[v.Name] = v
			if len(bound) == nVMs {
				close(all)
			}
		}
	}
	inf := c.virt.VMIs.Informer(benchNamespace, 0, nil)
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onVMI, UpdateFunc: func(_, n any) { onVMI(n) }})
	infCtx, infStop := context.WithCancel(ctx)
	defer infStop()
	go inf.RunWithContext(infCtx)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return p, ctx.Err()
	}

	before, err := measure.RequestCounts(ctx, c.kube)
	if err != nil {
		return p, err
	}
	latBefore, err := measure.Latencies(ctx, c.kube)
	if err != nil {
		return p, err
	}
	simWrites0 := c.sim.writes.Load()
	c.sim.maxGap.Store(0)
	failed0 := c.sim.failed.Load()
	brain0, api0, etcd0 := measure.CPUTime(pid), measure.CPUTime(c.apiPid), measure.CPUTime(c.etcdPid)
	start := time.Now()
	var failed atomic.Int64
	var firstErr atomic.Value
	var retried atomic.Int64
	_ = forEach(ctx, nVMs, 64, func(i int) error {
		// A refused create is tried again twice, as a client would (a
		// webhook that times out under load refuses it); each counts.
		var err error
		for try := 0; try < 3 && ctx.Err() == nil; try++ {
			if _, err = c.virt.VMs.Create(ctx, newVM(fmt.Sprintf("vm-%05d", i), true)); err == nil || apierrors.IsAlreadyExists(err) {
				return nil
			}
			if retried.Add(1) == 1 {
				firstErr.Store(err)
			}
		}
		failed.Add(1)
		return nil
	})
	p.Refused = retried.Load()
	if p.Refused > 0 {
		fmt.Fprintf(os.Stderr, "    %d creations refused and tried again, the first: %v\n", p.Refused, firstErr.Load())
	}
	p.Create = time.Since(start)
	if n := failed.Load(); n > 0 {
		return p, fmt.Errorf("%d of %d VM creations failed, the first: %v", n, nVMs, firstErr.Load())
	}
	// A generous bound: 10 times the 6 ms per VM target, at least 3 minutes.
	wait := max(3*time.Minute, time.Duration(nVMs)*60*time.Millisecond)
	select {
	case <-all:
	case <-time.After(wait - time.Since(start)):
	case <-ctx.Done():
		return p, ctx.Err()
	}
	p.Place = time.Since(start)
	mu.Lock()
	p.Placed = len(bound)
	mu.Unlock()
	p.PeakRSS = measure.MemMiB(pid, "VmHWM")

	// The brain's work that follows the bindings (VM status) counts too.
	if err := c.settle(ctx, t.settle); err != nil {
		return p, err
	}
	p.BrainCPU, p.APICPU, p.EtcdCPU = measure.CPUTime(pid)-brain0, measure.CPUTime(c.apiPid)-api0, measure.CPUTime(c.etcdPid)-etcd0
	after, err := measure.RequestCounts(ctx, c.kube)
	if err != nil {
		return p, err
	}
	rows, writes := measure.Delta(before, after)
	if latAfter, err := measure.Latencies(ctx, c.kube); err == nil {
		var b strings.Builder
		measure.WriteLatencyDelta(&b, latBefore, latAfter)
		p.Latencies = b.String()
	}
	p.Requests, p.Writes = rows, writes-float64(c.sim.writes.Load()-simWrites0)
	if err := c.brainAlive(); err != nil {
		return p, err
	}
	if p.Placed == nVMs {
		mu.Lock()
		err := verify(bound, c.sim.capacity.Memory().Value())
		mu.Unlock()
		if err != nil {
			return p, err
		}
	}
	if p.IdleAfter, p.BeatsAfter, err = c.idleCPU(ctx, t.idle); err != nil {
		return p, err
	}
	p.IdleRSS = measure.MemMiB(pid, "VmRSS")
	p.NotReady, p.SimGap = c.nodesNotReady(ctx), time.Duration(c.sim.maxGap.Load())
	p.SimFailed = c.sim.failed.Load() - failed0
	p.LoadAfter = loadavg()
	return p, nil
}

// settle waits at least d, and then until the brain uses less than a
// fifth of a core over two seconds (at most 6×d in all): the work that
// follows a burst is over before an idle window starts.
func (c *cluster) settle(ctx context.Context, d time.Duration) error {
	start := time.Now()
	if err := sleep(ctx, d); err != nil {
		return err
	}
	for time.Since(start) < 6*d {
		busy, _, err := c.idleCPU(ctx, 2*time.Second)
		if err != nil || busy < 0.2 {
			return err
		}
	}
	return nil
}

// idleCPU is the brain's CPU use over d, as a fraction of one core, and
// the simulated nodes' heartbeats per second meanwhile.
func (c *cluster) idleCPU(ctx context.Context, d time.Duration) (cpu, beats float64, err error) {
	pid := c.brain.Process.Pid
	cpu0, t0, w0 := measure.CPUTime(pid), time.Now(), c.sim.writes.Load()
	if err := sleep(ctx, d); err != nil {
		return 0, 0, err
	}
	if err := c.brainAlive(); err != nil {
		return 0, 0, err
	}
	wall := time.Since(t0).Seconds()
	// A heartbeat is two writes: the Node's status, the Lease.
	return (measure.CPUTime(pid) - cpu0).Seconds() / wall, float64(c.sim.writes.Load()-w0) / 2 / wall, nil
}

// verify checks the placements: every interface has a MAC no other has,
// and no node holds more guest memory than it has.
func verify(vmis map[string]*kubevirtv1.VirtualMachineInstance, nodeMemory int64) error {
	macs := map[string]string{}
	perNode := map[string]int64{}
	for _, v := range vmis {
		for _, iface := range v.Spec.Domain.Devices.Interfaces {
			if iface.MacAddress == "" {
				return fmt.Errorf("vmi %s interface %s has no mac", v.Name, iface.Name)
			}
			if other, dup := macs[iface.MacAddress]; dup {
				return fmt.Errorf("mac %s on both %s and %s", iface.MacAddress, other, v.Name)
			}
			macs[iface.MacAddress] = v.Name
		}
		perNode[v.Status.NodeName] += v.Spec.Domain.Memory.Guest.Value()
	}
	for node, mem := range perNode {
		if mem > nodeMemory {
			return fmt.Errorf("node %s overbooked: %d bytes of guest memory, %d available", node, mem, nodeMemory)
		}
	}
	return nil
}

// newVM is the bench's VM: 1 GiB, a container disk, the pod network and a
// bridge network (two MACs from the pool, one bridge resource).
func newVM(name string, running bool) *kubevirtv1.VirtualMachine {
	strategy := kubevirtv1.RunStrategyHalted
	if running {
		strategy = kubevirtv1.RunStrategyAlways
	}
	mem := resource.MustParse("1Gi")
	return &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: benchNamespace, Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &strategy, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "scale-bench"}},
			Spec: kubevirtv1.VirtualMachineInstanceSpec{
				Domain: kubevirtv1.DomainSpec{Memory: &kubevirtv1.Memory{Guest: &mem}, Devices: kubevirtv1.Devices{
					Disks: []kubevirtv1.Disk{{Name: "root"}},
					Interfaces: []kubevirtv1.Interface{
						{Name: "default", InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Masquerade: &kubevirtv1.InterfaceMasquerade{}}},
						{Name: "br1", InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Bridge: &kubevirtv1.InterfaceBridge{}}}}}},
				Networks: []kubevirtv1.Network{*kubevirtv1.DefaultPodNetwork(),
					{Name: "br1", NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "br1"}}}},
				Volumes: []kubevirtv1.Volume{{Name: "root", VolumeSource: kubevirtv1.VolumeSource{
					ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "example/disk"}}}}}}}}
}

func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// loadavg is the machine's load averages (1, 5, 15 minutes).
func loadavg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
