package metrics

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// sample is one scraped line.
type sample struct {
	labels map[string]string
	value  float64
}

var lineRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$`)
var labelRE = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// scrape reads url's text exposition into samples by metric name.
func scrape(t *testing.T, url string) map[string][]sample {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain; version=0.0.4") {
		t.Fatalf("GET %s: %s, content type %q", url, resp.Status, resp.Header.Get("Content-Type"))
	}
	out := map[string][]sample{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		m := lineRE.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("unparsable line %q", line)
		}
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		s := sample{labels: map[string]string{}, value: v}
		for _, l := range labelRE.FindAllStringSubmatch(m[2], -1) {
			s.labels[l[1]] = l[2]
		}
		out[m[1]] = append(out[m[1]], s)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// find returns the samples of name whose labels include want.
func find(samples map[string][]sample, name string, want map[string]string) []sample {
	var out []sample
next:
	for _, s := range samples[name] {
		for k, v := range want {
			if s.labels[k] != v {
				continue next
			}
		}
		out = append(out, s)
	}
	return out
}

// statsVMI is a tiny VMI: no bootable disk (the firmware keeps a vCPU
// busy), an empty scratch disk and a NIC on a tap.
func statsVMI(name, node string) *v1.VirtualMachineInstance {
	return &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{v1.NodeNameLabel: node}},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}},
				Devices: v1.Devices{
					AutoattachGraphicsDevice: new(bool),
					Disks:                    []v1.Disk{{Name: "scratch", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}},
					Interfaces: []v1.Interface{{Name: "net0", MacAddress: "02:00:5e:4e:4d:01",
						InterfaceBindingMethod: v1.InterfaceBindingMethod{Bridge: &v1.InterfaceBridge{}}}},
				},
			},
			Networks: []v1.Network{{Name: "net0", NetworkSource: v1.NetworkSource{Multus: &v1.MultusNetwork{NetworkName: "none"}}}},
			Volumes: []v1.Volume{{Name: "scratch", VolumeSource: v1.VolumeSource{EmptyDisk: &v1.EmptyDiskSource{
				Capacity: resource.MustParse("16Mi")}}}},
		},
	}
}

// bind creates vmi in ns as bound to node, in phase.
func bind(ctx context.Context, t *testing.T, virt *client.Set, ns string, vmi *v1.VirtualMachineInstance, phase v1.VirtualMachineInstancePhase) *v1.VirtualMachineInstance {
	t.Helper()
	vmi.Namespace = ns
	got, err := virt.VMIs.Create(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	got.Status.NodeName = vmi.Labels[v1.NodeNameLabel]
	got.Status.Phase = phase
	if got, err = virt.VMIs.UpdateStatus(ctx, got); err != nil {
		t.Fatal(err)
	}
	return got
}

// TestNodeMetrics runs a domain for a VMI of the node on the real libvirtd
// and scrapes the agent's /metrics: KubeVirt's per-VMI families with the
// VMI's namespace, name, node and device names, only this node's VMIs, and
// this node's phase counts.
func TestNodeMetrics(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	node := fmt.Sprintf("mnode-%05d", rand.IntN(100000))
	uri := libvirttest.Ensure(t)

	vmi := bind(ctx, t, virt, ns, statsVMI("stats", node), v1.Running)
	bind(ctx, t, virt, ns, statsVMI("waiting", node), v1.Scheduled)
	bind(ctx, t, virt, ns, statsVMI("elsewhere", node+"-other"), v1.Running)

	// The domain of "stats", made as the handler makes it.
	tap := fmt.Sprintf("nvmt%05d", rand.IntN(100000))
	if out, err := exec.Command("ip", "tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr").CombinedOutput(); err != nil {
		t.Fatalf("tap: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "link", "del", tap).Run() })
	stateDir, err := os.MkdirTemp("", "nodevirt-metrics-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	if err := os.Chmod(stateDir, 0o755); err != nil {
		t.Fatal(err)
	}
	env := domain.Env{Emulation: true, StateDir: stateDir, Taps: map[string]domain.Tap{"net0": {Dev: tap}}}
	dom, err := domain.Convert(vmi, env)
	if err != nil {
		t.Fatal(err)
	}
	if err := domain.Prepare(ctx, vmi, env); err != nil {
		t.Fatal(err)
	}
	lv, err := launcher.Open(launcher.Config{URI: uri, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer lv.Close()
	if err := lv.Create(ctx, dom, launcher.StartOptions{}); err != nil {
		t.Fatal(err)
	}
	defer lv.Undefine(context.Background(), dom.Name)

	// The statistics are read over connections the server is given (the
	// handler's in the agent): here a Manager of their own, so the test can
	// take it away.
	shared, err := launcher.Open(launcher.Config{URI: uri, Connections: 1, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	s, err := New(Config{NodeName: node, Addr: "127.0.0.1:0", Domains: shared, Virt: virt,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Run(runCtx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	id := map[string]string{"namespace": ns, "name": "stats", "node": node}
	var got map[string][]sample
	testkit.PollEvery(t, 250*time.Millisecond, 60*time.Second, fmt.Sprintf("cpu usage of %s/stats and phase counts of %s", ns, node), func() (bool, error) {
		if addr := s.Addr(); addr != "" {
			got = scrape(t, "http://"+addr+"/metrics")
			if c := find(got, "kubevirt_vmi_cpu_usage_seconds_total", id); len(c) == 1 && c[0].value > 0 &&
				len(find(got, "kubevirt_vmi_phase_count", map[string]string{"node": node})) == 2 {
				return true, nil
			}
		}
		return false, fmt.Errorf("got families %v", keys(got))
	})

	cpu := find(got, "kubevirt_vmi_cpu_usage_seconds_total", id)[0].value
	t.Logf("scraped %d families; %s/stats: cpu %.3fs, domain memory %g bytes", len(got), ns, cpu,
		firstValue(find(got, "kubevirt_vmi_memory_domain_bytes", id)))
	for _, c := range []struct {
		name  string
		extra map[string]string
		min   float64
	}{
		{"kubevirt_vmi_cpu_usage_seconds_total", nil, 1e-9},
		{"kubevirt_vmi_cpu_user_usage_seconds_total", nil, 0},
		{"kubevirt_vmi_cpu_system_usage_seconds_total", nil, 0},
		{"kubevirt_vmi_vcpu_seconds_total", map[string]string{"id": "0", "state": "running"}, 1e-9},
		{"kubevirt_vmi_vcpu_wait_seconds_total", map[string]string{"id": "0"}, 0},
		{"kubevirt_vmi_memory_domain_bytes", nil, 64 << 20},
		{"kubevirt_vmi_memory_actual_balloon_bytes", nil, 1},
		{"kubevirt_vmi_memory_resident_bytes", nil, 0},
		{"kubevirt_vmi_network_receive_bytes_total", map[string]string{"interface": "net0"}, 0},
		{"kubevirt_vmi_network_transmit_packets_total", map[string]string{"interface": "net0"}, 0},
		{"kubevirt_vmi_network_receive_packets_dropped_total", map[string]string{"interface": "net0"}, 0},
		{"kubevirt_vmi_storage_iops_read_total", map[string]string{"drive": "scratch"}, 0},
		{"kubevirt_vmi_storage_read_traffic_bytes_total", map[string]string{"drive": "scratch"}, 0},
		{"kubevirt_vmi_storage_flush_requests_total", map[string]string{"drive": "scratch"}, 0},
	} {
		want := map[string]string{}
		for k, v := range id {
			want[k] = v
		}
		for k, v := range c.extra {
			want[k] = v
		}
		ss := find(got, c.name, want)
		if len(ss) != 1 || ss[0].value < c.min {
			t.Errorf("%s%v: %+v, want one sample ≥ %g (all: %+v)", c.name, want, ss, c.min, got[c.name])
		}
	}
	if ss := find(got, "kubevirt_vmi_memory_domain_bytes", id); len(ss) == 1 && ss[0].value != 64<<20 {
		t.Errorf("kubevirt_vmi_memory_domain_bytes %g, want %d", ss[0].value, 64<<20)
	}
	// Only this node's VMIs: the shared libvirtd may run other tests'
	// domains, and "elsewhere" belongs to another node.
	for name, ss := range got {
		if !strings.HasPrefix(name, "kubevirt_vmi_") || name == "kubevirt_vmi_phase_count" {
			continue
		}
		for _, s := range ss {
			if s.labels["namespace"] != ns || s.labels["name"] != "stats" || s.labels["node"] != node {
				t.Errorf("%s reports a vmi that is not this node's running one: %v", name, s.labels)
			}
		}
	}
	for phase, want := range map[string]float64{"running": 1, "scheduled": 1} {
		ss := find(got, "kubevirt_vmi_phase_count", map[string]string{"node": node, "phase": phase})
		if len(ss) != 1 || ss[0].value != want {
			t.Errorf("kubevirt_vmi_phase_count{node=%s,phase=%s}: %+v, want %g", node, phase, ss, want)
		}
	}
	if ss := find(got, "kubevirt_vmi_phase_count", map[string]string{"node": node + "-other"}); len(ss) != 0 {
		t.Errorf("phase counts of another node: %+v", ss)
	}
	if len(got["kubevirt_vmi_info"]) != 0 {
		t.Errorf("kubevirt_vmi_info is the brain's, the node exposes %d series", len(got["kubevirt_vmi_info"]))
	}

	// The server opens no libvirt connection of its own: without the one
	// it was given, the running domain's series are gone.
	shared.Close()
	if ss := find(scrape(t, "http://"+s.Addr()+"/metrics"), "kubevirt_vmi_cpu_usage_seconds_total", id); len(ss) != 0 {
		t.Errorf("cpu usage read without the given libvirt connection: %+v", ss)
	}

	// A stopped domain leaves the per-VMI series (through a live
	// connection again).
	s2, err := New(Config{NodeName: node, Addr: "127.0.0.1:0", Domains: lv, Virt: virt, VMIs: s.vmis,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if ss := find(scrapeHandler(t, s2), "kubevirt_vmi_cpu_usage_seconds_total", id); len(ss) != 1 {
		t.Errorf("cpu usage of the running domain over the creating connection: %+v", ss)
	}
	if err := lv.Destroy(ctx, dom.Name); err != nil {
		t.Fatal(err)
	}
	if ss := find(scrapeHandler(t, s2), "kubevirt_vmi_cpu_usage_seconds_total", id); len(ss) != 0 {
		t.Errorf("cpu usage of a stopped domain: %+v", ss)
	}
}

// scrapeHandler scrapes s's handler without a listener.
func scrapeHandler(t *testing.T, s *Server) map[string][]sample {
	t.Helper()
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	return scrape(t, srv.URL)
}

func keys(m map[string][]sample) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func firstValue(ss []sample) float64 {
	if len(ss) == 0 {
		return -1
	}
	return ss[0].value
}
