// Command brain benchmarks the cluster brain's decisions: against a real
// API server with 100 registered nodes it creates 1,000 VirtualMachines at
// once and measures the wall time until every one has a MAC address from
// the pool and its VMI is bound to a node, and the brain's peak RSS. The
// brain runs in a child process (this binary re-executed with -run-brain)
// so its memory is measured alone.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/crds"
	"github.com/nodevirt/nodevirt/clusterbrain/macpool"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/clusterbrain/vmcontroller"
	"github.com/nodevirt/nodevirt/test/bench/measure"
	"github.com/nodevirt/nodevirt/test/bench/report"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

const brainNamespace = "kubevirt-hyperconverged"

func main() {
	runBrain := flag.Bool("run-brain", false, "run the brain roles (child mode)")
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig (child mode)")
	vms := flag.Int("vms", 1000, "virtual machines to create")
	nodes := flag.Int("nodes", 100, "nodes to register")
	share := flag.Bool("share-informers", true, "the roles share one VM and one VMI informer (as clusterbrain/brain does)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var err error
	if *runBrain {
		err = brain(ctx, *kubeconfig, *share)
	} else {
		err = bench(ctx, *vms, *nodes, *share)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench brain:", err)
		os.Exit(1)
	}
}

// brain runs the admission server with the MAC pool, the VM controller,
// the scheduler and the MAC reconciler until ctx ends.
func brain(ctx context.Context, kubeconfig string, share bool) error {
	if path := os.Getenv("NODEVIRT_BENCH_CPUPROFILE"); path != "" {
		f, err := os.Create(path)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	rc.QPS, rc.Burst = 200, 400 // as the brain's Deps
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	virt, err := client.NewSet(rc)
	if err != nil {
		return err
	}
	adm, err := admission.NewRole(admission.Config{Addr: "127.0.0.1:0", Namespace: brainNamespace},
		admission.Deps{Kube: kube, Virt: virt, Log: log}, macpool.Register(macpool.Config{RestConfig: rc, Namespace: brainNamespace}))
	if err != nil {
		return err
	}
	var vmInf, vmiInf cache.SharedIndexInformer
	if share {
		vmInf, vmiInf = virt.VMs.Informer("", 0, nil), virt.VMIs.Informer("", 0, nil)
	}
	sch, err := scheduler.New(scheduler.Config{RestConfig: rc, Log: log, VMIInformer: vmiInf})
	if err != nil {
		return err
	}
	vmc, err := vmcontroller.New(vmcontroller.Config{RestConfig: rc, Log: log, VMInformer: vmInf, VMIInformer: vmiInf, Placer: sch})
	if err != nil {
		return err
	}
	rec, err := macpool.NewReconciler(macpool.Config{RestConfig: rc, Virt: virt, Namespace: brainNamespace, Log: log, VMInformer: vmInf})
	if err != nil {
		return err
	}
	if share {
		go vmInf.RunWithContext(ctx)
		go vmiInf.RunWithContext(ctx)
	}
	var wg sync.WaitGroup
	for _, r := range []interface {
		Name() string
		Run(context.Context) error
	}{adm, vmc, sch, rec} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.Run(ctx); err != nil && ctx.Err() == nil {
				log.Error("role stopped", "role", r.Name(), "err", err)
			}
		}()
	}
	wg.Wait()
	return nil
}

func bench(ctx context.Context, nVMs, nNodes int, share bool) error {
	dir, err := os.MkdirTemp("", "nodevirt-bench-brain-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cp, err := controlplane.Start(ctx, controlplane.Config{Dir: dir, Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	defer cp.Stop()
	rc := rest.CopyConfig(cp.RestConfig)
	rc.QPS, rc.Burst = 2000, 4000
	kube := kubernetes.NewForConfigOrDie(rc)
	virt, err := client.NewSet(rc)
	if err != nil {
		return err
	}
	if err := crds.Install(ctx, apiextensionsclient.NewForConfigOrDie(rc), crds.Catalog()); err != nil {
		return err
	}
	for _, ns := range []string{brainNamespace, "bench"} {
		if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	if err := registerNodes(ctx, kube, nNodes); err != nil {
		return err
	}
	nad := &nadv1.NetworkAttachmentDefinition{ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: "br1",
		Annotations: map[string]string{scheduler.NADResourceName: scheduler.BridgePrefix + "br1"}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: `{"cniVersion":"0.3.1","type":"cnv-bridge","bridge":"br1"}`}}
	if _, err := virt.NADs.Create(ctx, nad); err != nil {
		return err
	}

	apiPid := apiserverPid(dir)
	anchor, anchorAPICPU, err := bareWrites(ctx, kube, virt, nVMs, apiPid)
	if err != nil {
		return fmt.Errorf("anchor: %w", err)
	}

	self, err := os.Executable()
	if err != nil {
		return err
	}
	// The brain runs under its own identity and roles, as a deployment
	// runs it (the lab and the e2e suite do the same).
	if err := rbac.EnsureDaemons(ctx, kube); err != nil {
		return fmt.Errorf("daemon roles: %w", err)
	}
	brainKC := filepath.Join(dir, "clusterbrain.kubeconfig")
	if err := cp.WriteKubeconfig(brainKC, identity.BrainUser, identity.BrainGroup); err != nil {
		return err
	}
	child := exec.CommandContext(ctx, self, "-run-brain", "-kubeconfig", brainKC, fmt.Sprintf("-share-informers=%t", share))
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		return err
	}
	defer func() { _ = child.Process.Signal(syscall.SIGTERM); _ = child.Wait() }()
	if err := waitBrain(ctx, virt); err != nil {
		return err
	}
	baseRSS := measure.MemMiB(child.Process.Pid, "VmRSS")
	countsBefore, err := measure.RequestCounts(ctx, kube)
	if err != nil {
		return err
	}
	latBefore, _ := measure.Latencies(ctx, kube)
	stopPerf := perfRecord(apiPid)
	apiCPU1 := measure.CPUTime(apiPid)
	etcdPid := measure.ControlPlanePid("etcd", dir)
	etcdCPU1, selfCPU1, brainCPU1 := measure.CPUTime(etcdPid), measure.CPUTime(os.Getpid()), measure.CPUTime(child.Process.Pid)

	// Bindings are observed through a watch started before the burst, not
	// by listing every VMI over and over, which would load the API server
	// the brain is measured against.
	boundCh := make(chan struct{})
	var boundN atomic.Int64
	var boundMu sync.Mutex
	boundSet := map[string]bool{}
	inf := virt.VMIs.Informer("bench", 0, nil)
	onVMI := func(obj any) {
		v, ok := obj.(*kubevirtv1.VirtualMachineInstance)
		if !ok || v.Status.NodeName == "" {
			return
		}
		boundMu.Lock()
		defer boundMu.Unlock()
		if !boundSet[v.Name] {
			boundSet[v.Name] = true
			if boundN.Add(1) == int64(nVMs) {
				close(boundCh)
			}
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onVMI, UpdateFunc: func(_, n any) { onVMI(n) }})
	infCtx, infStop := context.WithCancel(ctx)
	defer infStop()
	go inf.RunWithContext(infCtx)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return ctx.Err()
	}

	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Int64
	next := make(chan int, nVMs)
	for i := 0; i < nVMs; i++ {
		next <- i
	}
	close(next)
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if _, err := virt.VMs.Create(ctx, newVM(fmt.Sprintf("vm-%04d", i))); err != nil {
					failed.Add(1)
					fmt.Fprintln(os.Stderr, "create:", err)
				}
			}
		}()
	}
	wg.Wait()
	created := time.Since(start)
	if failed.Load() > 0 {
		return fmt.Errorf("%d creations failed", failed.Load())
	}
	select {
	case <-boundCh:
	case <-time.After(3 * time.Minute):
	case <-ctx.Done():
		return ctx.Err()
	}
	bound := int(boundN.Load())
	wall := time.Since(start)
	brainAPICPU := measure.CPUTime(apiPid) - apiCPU1
	etcdCPU, selfCPU, brainCPU := measure.CPUTime(etcdPid)-etcdCPU1, measure.CPUTime(os.Getpid())-selfCPU1, measure.CPUTime(child.Process.Pid)-brainCPU1
	stopPerf()
	peak := measure.MemMiB(child.Process.Pid, "VmHWM")
	if bound != nVMs {
		return fmt.Errorf("only %d of %d vmis bound after %s", bound, nVMs, wall)
	}
	if countsAfter, err := measure.RequestCounts(ctx, kube); err == nil {
		printRequestDelta(countsBefore, countsAfter, nVMs)
	}
	if latAfter, err := measure.Latencies(ctx, kube); err == nil {
		measure.WriteLatencyDelta(os.Stderr, latBefore, latAfter)
	}
	if err := verify(ctx, virt, kube, nVMs); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "created %d vms in %s, all bound in %s; brain rss %.1f MiB idle, %.1f MiB peak, cpu %s\n",
		nVMs, created, wall, baseRSS, peak, measure.CPUTime(child.Process.Pid))
	fmt.Fprintf(os.Stderr, "cpu during the burst: kube-apiserver %s, etcd %s, brain %s, this client %s; %.2f cores of %d on average\n",
		brainAPICPU, etcdCPU, brainCPU, selfCPU, (brainAPICPU+etcdCPU+brainCPU+selfCPU).Seconds()/wall.Seconds(), runtime.NumCPU())
	fmt.Fprintf(os.Stderr, "anchor: the same %d VMs, VMIs and bindings written with no brain took %s\n", nVMs, anchor)
	fmt.Fprintf(os.Stderr, "kube-apiserver cpu: %s during the burst with the brain, %s during the anchor's writes (%.1f ms vs %.1f ms per vm)\n",
		brainAPICPU, anchorAPICPU, float64(brainAPICPU.Milliseconds())/float64(nVMs), float64(anchorAPICPU.Milliseconds())/float64(nVMs))
	report.Emit(report.Result{Name: fmt.Sprintf("brain: MAC-assign + schedule %d VMs over %d nodes (wall)", nVMs, nNodes),
		Unit: "s", Value: wall.Seconds(), AnchorName: "bare API writes of the same objects, no brain", Anchor: anchor.Seconds(),
		Target: "< 10 s", LowerIsBetter: true, Met: wall < 10*time.Second})
	report.Emit(report.Result{Name: fmt.Sprintf("brain: peak RSS during %d-VM burst", nVMs),
		Unit: "MiB", Value: peak, AnchorName: "target", Target: "< 150 MiB", LowerIsBetter: true, Met: peak < 150})
	return nil
}

func registerNodes(ctx context.Context, kube kubernetes.Interface, n int) error {
	res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("64"), corev1.ResourceMemory: resource.MustParse("256Gi"),
		scheduler.BridgePrefix + "br1": resource.MustParse("1k"), scheduler.KVMResource: resource.MustParse("1k")}
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("node-%03d", i)
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			scheduler.SchedulableLabel: "true", "kubernetes.io/hostname": name}}}
		got, err := kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		got.Spec.Taints = nil // the apiserver's not-ready taint: these nodes are ready
		if got, err = kube.CoreV1().Nodes().Update(ctx, got, metav1.UpdateOptions{}); err != nil {
			return err
		}
		got.Status = corev1.NodeStatus{Capacity: res, Allocatable: res,
			Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}
		if _, err := kube.CoreV1().Nodes().UpdateStatus(ctx, got, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

func newVM(name string) *kubevirtv1.VirtualMachine {
	always := kubevirtv1.RunStrategyAlways
	mem := resource.MustParse("1Gi")
	return &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &always, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "bench"}},
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

// waitBrain waits until admissions go through the brain's webhooks.
func waitBrain(ctx context.Context, virt *client.Set) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		vm := newVM("probe")
		vm.Spec.RunStrategy = nil
		halted := kubevirtv1.RunStrategyHalted
		vm.Spec.RunStrategy = &halted
		got, err := virt.VMs.Create(ctx, vm)
		if err == nil {
			_ = virt.VMs.Delete(ctx, "bench", "probe", metav1.DeleteOptions{})
			if got.Spec.Template.Spec.Domain.Devices.Interfaces[0].MacAddress != "" {
				return nil
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("brain webhooks never became active")
}

// verify checks that every MAC is unique and no node is overbooked.
func verify(ctx context.Context, virt *client.Set, kube kubernetes.Interface, n int) error {
	vms, err := virt.VMs.List(ctx, "bench", metav1.ListOptions{})
	if err != nil {
		return err
	}
	seen := map[string]string{}
	for _, vm := range vms {
		for _, iface := range vm.Spec.Template.Spec.Domain.Devices.Interfaces {
			if iface.MacAddress == "" {
				return fmt.Errorf("%s/%s has no mac", vm.Name, iface.Name)
			}
			if o, dup := seen[iface.MacAddress]; dup {
				return fmt.Errorf("duplicate mac %s on %s and %s", iface.MacAddress, o, vm.Name)
			}
			seen[iface.MacAddress] = vm.Name
		}
	}
	if len(seen) != 2*n {
		return fmt.Errorf("%d macs for %d vms", len(seen), n)
	}
	vmis, err := virt.VMIs.List(ctx, "bench", metav1.ListOptions{})
	if err != nil {
		return err
	}
	created := map[string]time.Time{}
	for _, vm := range vms {
		created[vm.Name] = vm.CreationTimestamp.Time
	}
	var toVMI, toBind []time.Duration
	for _, v := range vmis {
		toVMI = append(toVMI, v.CreationTimestamp.Sub(created[v.Name]))
		for _, c := range v.Status.Conditions {
			if c.Type == "PodScheduled" {
				toBind = append(toBind, c.LastTransitionTime.Sub(v.CreationTimestamp.Time))
			}
		}
	}
	fmt.Fprintf(os.Stderr, "vm→vmi p50 %s p95 %s max %s; vmi→bound p50 %s p95 %s max %s (1s resolution)\n",
		report.Percentile(toVMI, 50), report.Percentile(toVMI, 95), report.Percentile(toVMI, 100),
		report.Percentile(toBind, 50), report.Percentile(toBind, 95), report.Percentile(toBind, 100))
	perNode := map[string]int64{}
	for _, v := range vmis {
		perNode[v.Status.NodeName] += v.Spec.Domain.Memory.Guest.Value()
	}
	for node, mem := range perNode {
		if mem > 256<<30 {
			return fmt.Errorf("node %s overbooked: %d bytes", node, mem)
		}
	}
	return nil
}

// perfRecord samples the API server's stacks with perf while the burst
// runs when NODEVIRT_BENCH_APISERVER_PERF names an output file (an
// analysis aid, off by default); the returned func stops it.
func perfRecord(pid int) func() {
	out := os.Getenv("NODEVIRT_BENCH_APISERVER_PERF")
	if out == "" || pid == 0 {
		return func() {}
	}
	cmd := exec.Command("perf", "record", "-F", "199", "-g", "-p", strconv.Itoa(pid), "-o", out)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "perf:", err)
		return func() {}
	}
	return func() { _ = cmd.Process.Signal(syscall.SIGINT); _ = cmd.Wait() }
}

// bareWrites is the anchor: the writes any brain must cause for n VMs
// (create the VM, create its VMI, bind it), done directly with no webhook
// and no controller, in a namespace deleted afterwards.
func bareWrites(ctx context.Context, kube kubernetes.Interface, virt *client.Set, n, apiPid int) (time.Duration, time.Duration, error) {
	const ns = "anchor"
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return 0, 0, err
	}
	next := make(chan int, n)
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	var firstErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	cpu0 := measure.CPUTime(apiPid)
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				vm := newVM(fmt.Sprintf("vm-%04d", i))
				vm.Namespace = ns
				halted := kubevirtv1.RunStrategyHalted
				vm.Spec.RunStrategy = &halted
				_, err := virt.VMs.Create(ctx, vm)
				var vmi *kubevirtv1.VirtualMachineInstance
				if err == nil {
					vmi, err = virt.VMIs.Create(ctx, &kubevirtv1.VirtualMachineInstance{
						ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: vm.Name}, Spec: vm.Spec.Template.Spec})
				}
				if err == nil {
					vmi.Status.NodeName, vmi.Status.Phase = "elsewhere", kubevirtv1.Succeeded
					_, err = virt.VMIs.UpdateStatus(ctx, vmi)
				}
				if err != nil {
					mu.Lock()
					firstErr = err
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	cpu := measure.CPUTime(apiPid) - cpu0
	if firstErr != nil {
		return 0, 0, firstErr
	}
	// Clean up so the brain's caches start as empty as in a real cluster.
	next2 := make(chan int, n)
	for i := 0; i < n; i++ {
		next2 <- i
	}
	close(next2)
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next2 {
				name := fmt.Sprintf("vm-%04d", i)
				_ = virt.VMIs.Delete(ctx, ns, name, metav1.DeleteOptions{})
				_ = virt.VMs.Delete(ctx, ns, name, metav1.DeleteOptions{})
			}
		}()
	}
	wg.Wait()
	return took, cpu, nil
}
