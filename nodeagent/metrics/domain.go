package metrics

import (
	"strconv"

	prom "github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// label is one label pair.
func label(name, value string) prom.Label { return prom.Label{Name: name, Value: value} }

// orNone is KubeVirt's label value for an empty one.
func orNone(s string) string {
	if s == "" {
		return "<none>"
	}
	return s
}

// DomainStats are the libvirt statistics of one VMI's domain
// (virConnectGetAllDomainStats: cpu, vcpu, balloon, interface, block), in
// libvirt's units, with the VMI it belongs to.
type DomainStats struct {
	Namespace, Name, Node string

	// CPU times in nanoseconds (cpu.time, cpu.user, cpu.system).
	CPUTime, CPUUser, CPUSystem uint64
	VCPUs                       []VCPUStats

	// Memory in KiB (balloon.*), faults as counts.
	MemoryAvailable, MemoryUnused, MemoryUsable, MemoryActualBalloon, MemoryRSS uint64
	SwapIn, SwapOut, MajorFaults, MinorFaults                                   uint64
	// MemoryDomain is the domain's configured memory in KiB.
	MemoryDomain uint64

	Interfaces []InterfaceStats
	Blocks     []BlockStats
}

// VCPUStats is one vCPU (vcpu.<n>.*), times in nanoseconds.
type VCPUStats struct {
	ID         int
	State      string // running, offline, blocked
	Time, Wait uint64
}

// InterfaceStats is one NIC (net.<n>.*), named by the VMI's interface name.
type InterfaceStats struct {
	Name                                    string
	RxBytes, RxPackets, RxErrors, RxDropped uint64
	TxBytes, TxPackets, TxErrors, TxDropped uint64
}

// BlockStats is one disk (block.<n>.*), named by the VMI's disk name;
// times in nanoseconds.
type BlockStats struct {
	Drive                                string
	ReadRequests, ReadBytes, ReadTime    uint64
	WriteRequests, WriteBytes, WriteTime uint64
	FlushRequests, FlushTime             uint64
}

type famSet struct {
	order []string
	fams  map[string]*prom.Family
}

func (fs *famSet) add(name, typ, help string, value float64, ls ...prom.Label) {
	f, ok := fs.fams[name]
	if !ok {
		f = &prom.Family{Name: name, Type: typ, Help: help}
		fs.fams[name] = f
		fs.order = append(fs.order, name)
	}
	f.Samples = append(f.Samples, prom.Sample{Labels: ls, Value: value})
}

const (
	ns2s  = 1e-9
	kib2b = 1024
)

// DomainCollector exposes KubeVirt's per-VMI metrics (kubevirt_vmi_cpu_*,
// kubevirt_vmi_vcpu_*, kubevirt_vmi_memory_*, kubevirt_vmi_network_*,
// kubevirt_vmi_storage_*) from the statistics stats returns at each scrape.
func DomainCollector(stats func() []DomainStats) prom.Collector {
	return prom.CollectorFunc(func() []prom.Family {
		fs := &famSet{fams: map[string]*prom.Family{}}
		c, g := prom.TypeCounter, prom.TypeGauge
		for _, d := range stats() {
			id := []prom.Label{label("namespace", d.Namespace), label("name", d.Name), label("node", d.Node)}
			with := func(extra ...prom.Label) []prom.Label { return append(append([]prom.Label(nil), id...), extra...) }
			fs.add("kubevirt_vmi_cpu_usage_seconds_total", c, "Total CPU time spent in all modes (sum of both vcpu and hypervisor usage).", float64(d.CPUTime)*ns2s, id...)
			fs.add("kubevirt_vmi_cpu_user_usage_seconds_total", c, "Total CPU time spent in user mode.", float64(d.CPUUser)*ns2s, id...)
			fs.add("kubevirt_vmi_cpu_system_usage_seconds_total", c, "Total CPU time spent in system mode.", float64(d.CPUSystem)*ns2s, id...)
			for _, v := range d.VCPUs {
				vid := label("id", itoa(v.ID))
				fs.add("kubevirt_vmi_vcpu_seconds_total", c, "Total amount of time spent in each state by each vcpu (cpu_time excluding hypervisor time).", float64(v.Time)*ns2s, with(vid, label("state", orNone(v.State)))...)
				fs.add("kubevirt_vmi_vcpu_wait_seconds_total", c, "Amount of time spent by each vcpu while waiting on I/O.", float64(v.Wait)*ns2s, with(vid)...)
			}
			fs.add("kubevirt_vmi_memory_available_bytes", g, "Amount of usable memory as seen by the domain.", float64(d.MemoryAvailable*kib2b), id...)
			fs.add("kubevirt_vmi_memory_unused_bytes", g, "The amount of memory left completely unused by the system.", float64(d.MemoryUnused*kib2b), id...)
			fs.add("kubevirt_vmi_memory_usable_bytes", g, "The amount of memory which can be reclaimed by balloon without pushing the guest system to swap.", float64(d.MemoryUsable*kib2b), id...)
			fs.add("kubevirt_vmi_memory_actual_balloon_bytes", g, "Current balloon size in bytes.", float64(d.MemoryActualBalloon*kib2b), id...)
			fs.add("kubevirt_vmi_memory_resident_bytes", g, "Resident set size of the process running the domain.", float64(d.MemoryRSS*kib2b), id...)
			fs.add("kubevirt_vmi_memory_domain_bytes", g, "The amount of memory in bytes allocated to the domain.", float64(d.MemoryDomain*kib2b), id...)
			fs.add("kubevirt_vmi_memory_used_bytes", g, "Amount of used memory as seen by the domain.", float64(sub(d.MemoryAvailable, d.MemoryUsable)*kib2b), id...)
			fs.add("kubevirt_vmi_memory_swap_in_traffic_bytes", g, "The total amount of data read from swap space of the guest in bytes.", float64(d.SwapIn*kib2b), id...)
			fs.add("kubevirt_vmi_memory_swap_out_traffic_bytes", g, "The total amount of memory written out to swap space of the guest in bytes.", float64(d.SwapOut*kib2b), id...)
			fs.add("kubevirt_vmi_memory_pgmajfault_total", c, "The number of page faults when disk IO was required.", float64(d.MajorFaults), id...)
			fs.add("kubevirt_vmi_memory_pgminfault_total", c, "The number of other page faults, when disk IO was not required.", float64(d.MinorFaults), id...)
			for _, n := range d.Interfaces {
				ifl := with(label("interface", n.Name))
				fs.add("kubevirt_vmi_network_receive_bytes_total", c, "Total network traffic received in bytes.", float64(n.RxBytes), ifl...)
				fs.add("kubevirt_vmi_network_transmit_bytes_total", c, "Total network traffic transmitted in bytes.", float64(n.TxBytes), ifl...)
				fs.add("kubevirt_vmi_network_receive_packets_total", c, "Total network traffic received packets.", float64(n.RxPackets), ifl...)
				fs.add("kubevirt_vmi_network_transmit_packets_total", c, "Total network traffic transmitted packets.", float64(n.TxPackets), ifl...)
				fs.add("kubevirt_vmi_network_receive_errors_total", c, "Total network received error packets.", float64(n.RxErrors), ifl...)
				fs.add("kubevirt_vmi_network_transmit_errors_total", c, "Total network transmitted error packets.", float64(n.TxErrors), ifl...)
				fs.add("kubevirt_vmi_network_receive_packets_dropped_total", c, "The total number of rx packets dropped on vNIC interfaces.", float64(n.RxDropped), ifl...)
				fs.add("kubevirt_vmi_network_transmit_packets_dropped_total", c, "The total number of tx packets dropped on vNIC interfaces.", float64(n.TxDropped), ifl...)
			}
			for _, b := range d.Blocks {
				dl := with(label("drive", b.Drive))
				fs.add("kubevirt_vmi_storage_read_traffic_bytes_total", c, "Total number of bytes read from storage.", float64(b.ReadBytes), dl...)
				fs.add("kubevirt_vmi_storage_write_traffic_bytes_total", c, "Total number of written bytes.", float64(b.WriteBytes), dl...)
				fs.add("kubevirt_vmi_storage_iops_read_total", c, "Total number of I/O read operations.", float64(b.ReadRequests), dl...)
				fs.add("kubevirt_vmi_storage_iops_write_total", c, "Total number of I/O write operations.", float64(b.WriteRequests), dl...)
				fs.add("kubevirt_vmi_storage_read_times_seconds_total", c, "Total time spent on read operations.", float64(b.ReadTime)*ns2s, dl...)
				fs.add("kubevirt_vmi_storage_write_times_seconds_total", c, "Total time spent on write operations.", float64(b.WriteTime)*ns2s, dl...)
				fs.add("kubevirt_vmi_storage_flush_requests_total", c, "Total storage flush requests.", float64(b.FlushRequests), dl...)
				fs.add("kubevirt_vmi_storage_flush_times_seconds_total", c, "Total time spent on cache flushing.", float64(b.FlushTime)*ns2s, dl...)
			}
		}
		out := make([]prom.Family, 0, len(fs.order))
		for _, n := range fs.order {
			out = append(out, *fs.fams[n])
		}
		return out
	})
}

func sub(a, b uint64) uint64 {
	if b > a {
		return 0
	}
	return a - b
}

func itoa(i int) string { return strconv.Itoa(i) }
