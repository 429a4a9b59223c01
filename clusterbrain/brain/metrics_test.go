package brain

import (
	"context"
	"maps"
	"net"
	"net/http"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// The metrics endpoints carry no authentication, so by default they listen
// on loopback only: the brain's server on its default address answers on
// 127.0.0.1 and refuses a connection to the host's own address.
func TestMetricsListenOnLoopbackByDefault(t *testing.T) {
	host, port, err := net.SplitHostPort(DefaultMetricsAddr)
	if err != nil {
		t.Fatal(err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		t.Fatalf("default brain metrics address %s is not loopback", DefaultMetricsAddr)
	}
	// The same rule with a free port: serve on the default host.
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	_ = port
	s := &metrics.Server{Addr: addr, Registry: metrics.NewRegistry()}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = s.Run(ctx) }()
	testkit.Eventually(t, 5*time.Second, "the metrics server", func() error {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err == nil {
			resp.Body.Close()
		}
		return err
	})
	ip, err := uploadtls.HostIP()
	if err != nil || ip.IsLoopback() {
		t.Skipf("no non-loopback host address to try (%v)", err)
	}
	_, p, _ := net.SplitHostPort(addr)
	if c, err := net.DialTimeout("tcp", net.JoinHostPort(ip.String(), p), 2*time.Second); err == nil {
		c.Close()
		t.Fatalf("metrics answer on the host address %s", ip)
	}
}

// kubevirt_vmi_non_evictable is 1 only for a VMI whose eviction strategy
// (its own, else the KubeVirt CR's) is LiveMigrate and that is not
// LiveMigratable; ended VMIs have no series.
func TestNonEvictableMetric(t *testing.T) {
	strategy := func(s kubevirtv1.EvictionStrategy) *kubevirtv1.EvictionStrategy { return &s }
	cond := func(s corev1.ConditionStatus) []kubevirtv1.VirtualMachineInstanceCondition {
		return []kubevirtv1.VirtualMachineInstanceCondition{{Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: s}}
	}
	vmi := func(name string, s *kubevirtv1.EvictionStrategy, conds []kubevirtv1.VirtualMachineInstanceCondition, phase kubevirtv1.VirtualMachineInstancePhase) *kubevirtv1.VirtualMachineInstance {
		return &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
			Spec:   kubevirtv1.VirtualMachineInstanceSpec{EvictionStrategy: s},
			Status: kubevirtv1.VirtualMachineInstanceStatus{NodeName: "n1", Phase: phase, Conditions: conds}}
	}
	vmis := []*kubevirtv1.VirtualMachineInstance{
		vmi("stuck", strategy(kubevirtv1.EvictionStrategyLiveMigrate), cond(corev1.ConditionFalse), kubevirtv1.Running),
		vmi("unknown", strategy(kubevirtv1.EvictionStrategyLiveMigrate), nil, kubevirtv1.Running),
		vmi("movable", strategy(kubevirtv1.EvictionStrategyLiveMigrate), cond(corev1.ConditionTrue), kubevirtv1.Running),
		vmi("ifpossible", strategy(kubevirtv1.EvictionStrategyLiveMigrateIfPossible), cond(corev1.ConditionFalse), kubevirtv1.Running),
		vmi("cluster-default", nil, cond(corev1.ConditionFalse), kubevirtv1.Running),
		vmi("ended", strategy(kubevirtv1.EvictionStrategyLiveMigrate), cond(corev1.ConditionFalse), kubevirtv1.Succeeded),
	}
	kvs := cache.NewStore(cache.MetaNamespaceKeyFunc)
	list := func() []*kubevirtv1.VirtualMachineInstance { return vmis }
	values := func() map[string]float64 {
		out := map[string]float64{}
		for _, f := range nonEvictableCollector(list, kvs).Collect() {
			for _, s := range f.Samples {
				out[s.Labels[2].Value] = s.Value
			}
		}
		return out
	}
	want := map[string]float64{"stuck": 1, "unknown": 1, "movable": 0, "ifpossible": 0, "cluster-default": 0}
	if got := values(); !maps.Equal(got, want) {
		t.Errorf("without a cluster default: %v, want %v", got, want)
	}
	if err := kvs.Add(&kubevirtv1.KubeVirt{ObjectMeta: metav1.ObjectMeta{Namespace: "kubevirt", Name: "kubevirt"},
		Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{EvictionStrategy: strategy(kubevirtv1.EvictionStrategyLiveMigrate)}}}); err != nil {
		t.Fatal(err)
	}
	want["cluster-default"] = 1
	if got := values(); !maps.Equal(got, want) {
		t.Errorf("with the CR's LiveMigrate: %v, want %v", got, want)
	}
}
