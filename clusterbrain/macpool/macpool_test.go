package macpool

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/api/macpool/v1alpha1"
	cnaov1 "github.com/nodevirt/nodevirt/clusterbrain/api/networkaddons/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

func TestRangeParsing(t *testing.T) {
	r, err := ParseRange("02:00:00:00:00:10", "02:00:00:00:00:1F")
	if err != nil || r.Size() != 16 || FormatMAC(r.End) != "02:00:00:00:00:1f" {
		t.Fatalf("got %v %v", r, err)
	}
	for _, bad := range [][2]string{{"02:00:00:00:00:10", "02:00:00:00:00:01"}, {"03:00:00:00:00:00", "03:00:00:00:00:10"}, {"zz", "02:00:00:00:00:00"}} {
		if _, err := ParseRange(bad[0], bad[1]); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

type env struct {
	rc   *rest.Config
	kube kubernetes.Interface
	virt *client.Set
	ns   string
	log  *slog.Logger
}

func setup(t *testing.T) env {
	t.Helper()
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	rc := rest.CopyConfig(cp.RestConfig)
	rc.QPS, rc.Burst = 500, 1000
	virt, err := client.NewSet(rc)
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return env{rc: rc, kube: kube, virt: virt, ns: cp.Namespace(t),
		log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
}

// brain runs a webhook server with a pool until stop is called.
type brain struct {
	pool *Pool
	srv  *admission.Server
	stop func()
}

func startBrain(t *testing.T, e env, crash func() bool) *brain {
	t.Helper()
	p, err := New(Config{RestConfig: e.rc, Virt: e.virt, Namespace: e.ns, Log: e.log})
	if err != nil {
		t.Fatal(err)
	}
	p.crashAfterPersist = crash
	s, err := admission.New(admission.Config{Addr: "127.0.0.1:0", Namespace: e.ns}, admission.Deps{Kube: e.kube, Virt: e.virt, Log: e.log})
	if err != nil {
		t.Fatal(err)
	}
	s.Go(p.Run)
	s.Register(p.Webhook())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	<-s.Ready()
	<-p.synced
	b := &brain{pool: p, srv: s}
	var once sync.Once
	b.stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(b.stop)
	return b
}

func startReconciler(t *testing.T, e env, grace time.Duration) {
	t.Helper()
	r, err := NewReconciler(Config{RestConfig: e.rc, Virt: e.virt, Namespace: e.ns, Grace: grace, Log: e.log})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

func cleanupPool(t *testing.T, e env) {
	t.Cleanup(func() {
		ctx := context.Background()
		_ = admission.Uninstall(ctx, e.kube, e.ns)
		_ = e.virt.NetworkAddonsConfigs.Delete(ctx, "", "cluster", metav1.DeleteOptions{})
		st, _ := newStore(e.rc)
		items, _ := st.list(ctx)
		for i := range items {
			_ = st.delete(ctx, &items[i])
		}
	})
}

func setRange(t *testing.T, e env, start, end string) {
	t.Helper()
	ctx := context.Background()
	nac, err := e.virt.NetworkAddonsConfigs.Get(ctx, "", "cluster")
	if err != nil {
		nac = &cnaov1.NetworkAddonsConfig{ObjectMeta: metav1.ObjectMeta{Name: "cluster"}}
		nac.Spec.KubeMacPool = &cnaov1.KubeMacPool{RangeStart: start, RangeEnd: end}
		if _, err := e.virt.NetworkAddonsConfigs.Create(ctx, nac); err != nil {
			t.Fatal(err)
		}
		return
	}
	nac.Spec.KubeMacPool = &cnaov1.KubeMacPool{RangeStart: start, RangeEnd: end}
	if _, err := e.virt.NetworkAddonsConfigs.Update(ctx, nac); err != nil {
		t.Fatal(err)
	}
}

func waitRange(t *testing.T, p *Pool, start string) {
	t.Helper()
	want, _ := ParseMAC(start)
	testkit.Poll(t, 10*time.Second, "range "+start+" to apply", func() (bool, error) {
		return p.Range().Start == want, fmt.Errorf("have %s", p.Range())
	})
}

// vm returns a VM with one interface per binding ("bridge", "masquerade",
// or a MAC address for an explicit bridge interface).
func vm(ns, name string, nics ...string) *kubevirtv1.VirtualMachine {
	halted := kubevirtv1.RunStrategyHalted
	mem := resource.MustParse("64Mi")
	spec := kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Memory: &kubevirtv1.Memory{Guest: &mem}}}
	for i, n := range nics {
		name := fmt.Sprintf("nic%d", i)
		iface := kubevirtv1.Interface{Name: name}
		net := kubevirtv1.Network{Name: name, NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "br1"}}}
		switch n {
		case "masquerade":
			iface.Masquerade = &kubevirtv1.InterfaceMasquerade{}
			net.NetworkSource = kubevirtv1.NetworkSource{Pod: &kubevirtv1.PodNetwork{}}
		case "bridge":
			iface.Bridge = &kubevirtv1.InterfaceBridge{}
		default:
			iface.Bridge = &kubevirtv1.InterfaceBridge{}
			iface.MacAddress = n
		}
		spec.Domain.Devices.Interfaces = append(spec.Domain.Devices.Interfaces, iface)
		spec.Networks = append(spec.Networks, net)
	}
	v := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &halted, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: spec}}}
	if strings.HasSuffix(name, "-") {
		v.Name, v.GenerateName = "", name
	}
	return v
}

func macs(v *kubevirtv1.VirtualMachine) []string {
	var out []string
	for _, i := range v.Spec.Template.Spec.Domain.Devices.Interfaces {
		out = append(out, i.MacAddress)
	}
	return out
}

// persisted lists every persisted address with its owner's name.
func persisted(t *testing.T, e env) map[string][]string {
	t.Helper()
	st, _ := newStore(e.rc)
	items, err := st.list(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, it := range items {
		if !it.IsBlock() {
			out[it.Spec.MAC] = append(out[it.Spec.MAC], it.Spec.VMName)
			continue
		}
		for _, en := range it.Spec.Entries {
			out[en.MAC] = append(out[en.MAC], en.VMName)
		}
	}
	return out
}

func countAllocations(t *testing.T, e env) int {
	t.Helper()
	return len(persisted(t, e))
}

func TestAdmissionAssignsHonoursRefusesAndFrees(t *testing.T) {
	e := setup(t)
	cleanupPool(t, e)
	setRange(t, e, "02:aa:00:00:00:00", "02:aa:00:00:00:04")
	b := startBrain(t, e, nil)
	startReconciler(t, e, time.Second)
	waitRange(t, b.pool, "02:aa:00:00:00:00")
	ctx := context.Background()

	got, err := e.virt.VMs.Create(ctx, vm(e.ns, "a", "bridge", "masquerade", "bridge"))
	if err != nil {
		t.Fatal(err)
	}
	m := macs(got)
	if len(m) != 3 || m[0] == m[1] || m[1] == m[2] || m[0] == m[2] {
		t.Fatalf("macs %v", m)
	}
	for _, x := range m {
		if !strings.HasPrefix(x, "02:aa:00:00:00:0") {
			t.Errorf("mac %s outside the range", x)
		}
	}
	_, err = e.virt.VMs.Create(ctx, vm(e.ns, "b", m[1]))
	if err == nil || !strings.Contains(err.Error(), "mac address "+m[1]+" is already in use by "+e.ns+"/a") {
		t.Errorf("taken mac: %v", err)
	}
	if got, err := e.virt.VMs.Create(ctx, vm(e.ns, "c", "02:BB:00:00:00:01")); err != nil || macs(got)[0] != "02:BB:00:00:00:01" {
		t.Errorf("explicit free mac: %v %v", err, got)
	}
	before := countAllocations(t, e) // 3 + the explicit one
	if before != 4 {
		t.Errorf("%d allocations, want 4", before)
	}
	// 2 of 5 left: a VM wanting 3 is refused and keeps nothing.
	_, err = e.virt.VMs.Create(ctx, vm(e.ns, "d", "bridge", "bridge", "bridge"))
	if err == nil || !strings.Contains(err.Error(), "mac pool exhausted: all 5 addresses of 02:aa:00:00:00:00-02:aa:00:00:00:04 are in use") {
		t.Errorf("exhaustion: %v", err)
	}
	if n := countAllocations(t, e); n != before {
		t.Errorf("failed admission left %d allocations, want %d", n, before)
	}
	var u Usage
	_ = testkit.Wait(testkit.Interval, 5*time.Second, "the pool's usage", func() (bool, error) {
		u = b.pool.Usage() // from the informer, which may lag a moment
		return u.Used == 3 && u.Outside == 1, nil
	})
	if u.Total != 5 || u.Used != 3 || u.Outside != 1 {
		t.Errorf("usage %+v, want 3 of 5 used and 1 outside", u)
	}
	if ru, err := ReadUsage(ctx, Config{RestConfig: e.rc, Virt: e.virt, Namespace: e.ns}); err != nil || ru != u {
		t.Errorf("ReadUsage %+v %v, want %+v", ru, err, u)
	}
	rec := httptest.NewRecorder()
	metrics.Default().Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	for _, want := range []string{"nodevirt_mac_pool_size 5", "nodevirt_mac_pool_used 3", "nodevirt_mac_pool_outside_range 1"} {
		if !strings.Contains(rec.Body.String(), want+"\n") {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	// A range change applies without restart.
	setRange(t, e, "02:cc:00:00:00:00", "02:cc:00:00:00:ff")
	waitRange(t, b.pool, "02:cc:00:00:00:00")
	got, err = e.virt.VMs.Create(ctx, vm(e.ns, "e", "bridge"))
	if err != nil || !strings.HasPrefix(macs(got)[0], "02:cc:") {
		t.Errorf("after range change: %v %v", err, got)
	}
	// Updating a VM keeps its addresses; a new interface gets one.
	got.Spec.Template.Spec.Domain.Devices.Interfaces = append(got.Spec.Template.Spec.Domain.Devices.Interfaces,
		kubevirtv1.Interface{Name: "nic1", InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Bridge: &kubevirtv1.InterfaceBridge{}}})
	got.Spec.Template.Spec.Networks = append(got.Spec.Template.Spec.Networks,
		kubevirtv1.Network{Name: "nic1", NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: "br1"}}})
	upd, err := e.virt.VMs.Update(ctx, got)
	if err != nil || macs(upd)[0] != macs(got)[0] || macs(upd)[1] == "" {
		t.Errorf("update: %v %v", err, upd)
	}

	// Opted-out namespaces are left alone.
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.ns + "-out", Labels: map[string]string{OptOutLabel: "ignore"}}}
	if _, err := e.kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.kube.CoreV1().Namespaces().Delete(ctx, ns.Name, metav1.DeleteOptions{}) })
	if got, err := e.virt.VMs.Create(ctx, vm(ns.Name, "ignored", "bridge")); err != nil || macs(got)[0] != "" {
		t.Errorf("opt-out: %v %v", err, got)
	}

	// Deleting a VM frees its addresses.
	if err := e.virt.VMs.Delete(ctx, e.ns, "a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	want := countAllocations(t, e) - 3
	if err := testkit.Wait(200*time.Millisecond, 20*time.Second, "the deleted vm's allocations to go", func() (bool, error) {
		return countAllocations(t, e) == want, nil
	}); err != nil {
		t.Errorf("allocations of a deleted vm not freed: %d left, want %d", countAllocations(t, e), want)
	}
	// ... and the address can be requested explicitly again.
	if _, err := e.virt.VMs.Create(ctx, vm(e.ns, "b", m[1])); err != nil {
		t.Errorf("freed mac not reusable: %v", err)
	}
}

// TestBurstWithBrainKilled creates 500 VMs from 32 concurrent clients while
// the brain crashes after persisting (every 7th admission) and is then
// killed outright and replaced midway; no address may be handed out twice
// and no allocation may outlive the reconciliation.
func TestBurstWithBrainKilled(t *testing.T) {
	e := setup(t)
	cleanupPool(t, e)
	setRange(t, e, "02:dd:00:00:00:00", "02:dd:00:00:ff:ff")
	var calls atomic.Int64
	a := startBrain(t, e, func() bool { return calls.Add(1)%7 == 0 })
	waitRange(t, a.pool, "02:dd:00:00:00:00")
	ctx := context.Background()

	const total = 500
	var created atomic.Int64
	var failures atomic.Int64
	next := make(chan int, total)
	for i := 0; i < total; i++ {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var lastErr error
	for w := 0; w < 32; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				for attempt := 0; ; attempt++ {
					_, err := e.virt.VMs.Create(ctx, vm(e.ns, fmt.Sprintf("burst-%03d", i), "bridge", "masquerade"))
					if err == nil {
						created.Add(1)
						break
					}
					failures.Add(1)
					if attempt > 200 {
						mu.Lock()
						lastErr = err
						mu.Unlock()
						return
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	for created.Load() < total/2 {
		time.Sleep(10 * time.Millisecond)
	}
	a.stop() // the brain dies mid-burst
	time.Sleep(300 * time.Millisecond)
	startBrain(t, e, nil)
	wg.Wait()
	if lastErr != nil {
		t.Fatalf("creation never succeeded: %v", lastErr)
	}
	if failures.Load() == 0 {
		t.Error("no admission failed: the kill did not happen mid-burst")
	}
	vms, err := e.virt.VMs.List(ctx, e.ns, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != total {
		t.Fatalf("%d vms, want %d", len(vms), total)
	}
	owner := map[string]string{}
	for _, v := range vms {
		for _, m := range macs(v) {
			if m == "" {
				t.Errorf("%s has an interface without mac", v.Name)
			}
			if o, dup := owner[m]; dup {
				t.Errorf("duplicate mac %s: %s and %s", m, o, v.Name)
			}
			owner[m] = v.Name
		}
	}
	leaked := countAllocations(t, e) - 2*total
	t.Logf("%d vms, %d failed attempts, %d allocations beyond the vms' before reconciliation", total, failures.Load(), leaked)
	startReconciler(t, e, 2*time.Second)
	err = testkit.Wait(250*time.Millisecond, 30*time.Second, "allocations matching the vms", func() (bool, error) {
		items := persisted(t, e)
		if len(items) != 2*total {
			return false, nil
		}
		for mac, holders := range items {
			if len(holders) != 1 || owner[mac] != holders[0] {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Errorf("allocations never matched the vms exactly: %d allocations for %d addresses", countAllocations(t, e), 2*total)
	}
}

// TestTwoPoolsNeverShareAnAddress runs two pools (two brains) assigning
// at once into the same blocks, so their group commits conflict; every
// address handed out must be distinct and persisted for its VM.
func TestTwoPoolsNeverShareAnAddress(t *testing.T) {
	e := setup(t)
	cleanupPool(t, e)
	setRange(t, e, "02:ee:00:00:00:00", "02:ee:00:00:03:ff")
	var pools []*Pool
	for i := 0; i < 2; i++ {
		p, err := New(Config{RestConfig: e.rc, Virt: e.virt, Namespace: e.ns, Log: e.log})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = p.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
		<-p.synced
		waitRange(t, p, "02:ee:00:00:00:00")
		pools = append(pools, p)
	}
	const total = 300
	var mu sync.Mutex
	owner := map[string]string{}
	var dups []string
	var wg sync.WaitGroup
	errs := make(chan error, total)
	for i := 0; i < total; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v := vm(e.ns, fmt.Sprintf("two-%03d", i), "bridge", "masquerade")
			ops, err := pools[i%2].Assign(context.Background(), v, nil, false)
			if err != nil {
				errs <- err
				return
			}
			ifaces := ops[0].Value.([]kubevirtv1.Interface)
			mu.Lock()
			defer mu.Unlock()
			for _, iface := range ifaces {
				if o, dup := owner[iface.MacAddress]; dup {
					dups = append(dups, iface.MacAddress+" "+o+" "+v.Name)
				}
				owner[iface.MacAddress] = v.Name
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("assign: %v", err)
	}
	if len(dups) > 0 {
		t.Fatalf("addresses handed out twice: %v", dups)
	}
	if len(owner) != 2*total {
		t.Fatalf("%d addresses for %d interfaces", len(owner), 2*total)
	}
	got := persisted(t, e)
	for mac, name := range owner {
		if h := got[mac]; len(h) != 1 || h[0] != name {
			t.Errorf("address %s persisted for %v, handed to %s", mac, h, name)
		}
	}
}

func TestBlockNames(t *testing.T) {
	a, _ := ParseMAC("02:00:00:00:01:2f")
	b, _ := ParseMAC("02:00:00:00:01:20")
	c, _ := ParseMAC("02:00:00:00:01:30")
	if macv1alpha1.BlockName(a) != "block-02-00-00-00-01-20" || macv1alpha1.BlockName(a) != macv1alpha1.BlockName(b) {
		t.Errorf("block of %s: %s", FormatMAC(a), macv1alpha1.BlockName(a))
	}
	if macv1alpha1.BlockName(c) == macv1alpha1.BlockName(a) {
		t.Errorf("%s and %s share a block", FormatMAC(a), FormatMAC(c))
	}
}
