package metrics

import (
	"bytes"
	"strings"
	"testing"

	prom "github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// DomainCollector turns libvirt's units (ns, KiB) into KubeVirt's families.
func TestDomainCollector(t *testing.T) {
	r := prom.NewRegistry()
	r.Register(DomainCollector(func() []DomainStats {
		return []DomainStats{{Namespace: "ns", Name: "a", Node: "n1", CPUTime: 2_500_000_000, MemoryAvailable: 1024, MemoryUsable: 256,
			VCPUs:      []VCPUStats{{ID: 0, State: "running", Time: 1e9}},
			Interfaces: []InterfaceStats{{Name: "default", RxBytes: 100, TxBytes: 200}},
			Blocks:     []BlockStats{{Drive: "rootdisk", ReadBytes: 4096, ReadRequests: 1, WriteTime: 5e8}}}}
	}))
	var out bytes.Buffer
	if err := prom.WriteText(&out, r.Gather()); err != nil {
		t.Fatal(err)
	}
	for _, l := range []string{
		`kubevirt_vmi_cpu_usage_seconds_total{namespace="ns",name="a",node="n1"} 2.5`,
		`kubevirt_vmi_vcpu_seconds_total{namespace="ns",name="a",node="n1",id="0",state="running"} 1`,
		`kubevirt_vmi_memory_available_bytes{namespace="ns",name="a",node="n1"} 1048576`,
		`kubevirt_vmi_memory_used_bytes{namespace="ns",name="a",node="n1"} 786432`,
		`kubevirt_vmi_network_receive_bytes_total{namespace="ns",name="a",node="n1",interface="default"} 100`,
		`kubevirt_vmi_storage_read_traffic_bytes_total{namespace="ns",name="a",node="n1",drive="rootdisk"} 4096`,
		`kubevirt_vmi_storage_write_times_seconds_total{namespace="ns",name="a",node="n1",drive="rootdisk"} 0.5`,
	} {
		if !strings.Contains(out.String(), l+"\n") {
			t.Errorf("exposition lacks %q:\n%s", l, out.String())
		}
	}
}
