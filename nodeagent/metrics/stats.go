package metrics

import (
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// statsTypes are the statistics groups KubeVirt's per-VMI metrics need.
const statsTypes = libvirt.DOMAIN_STATS_STATE | libvirt.DOMAIN_STATS_CPU_TOTAL | libvirt.DOMAIN_STATS_BALLOON |
	libvirt.DOMAIN_STATS_VCPU | libvirt.DOMAIN_STATS_INTERFACE | libvirt.DOMAIN_STATS_BLOCK

// DomainStatsSource reads libvirt's statistics of the node's domains: the
// node agent's own libvirt connections (launcher.Manager, opened by the
// handler), so the metrics open none of their own. When it fails (libvirtd
// unreachable, not connected yet) a scrape exposes no per-VMI series.
type DomainStatsSource interface {
	AllDomainStats(stats libvirt.DomainStatsTypes, flags libvirt.ConnectGetAllDomainStatsFlags) ([]libvirt.DomainStats, error)
}

var _ DomainStatsSource = (*launcher.Manager)(nil)

// domainStats gathers the statistics of this node's VMIs' domains from src.
type domainStats struct {
	src  DomainStatsSource
	node string
	// vmi returns the node's VMI namespace/name, nil when there is none.
	vmi func(namespace, name string) *v1.VirtualMachineInstance
	log *slog.Logger

	mu      sync.Mutex
	devices map[string]*domainDevices // by domain UUID and ID: one run of a domain
}

// domainDevices is what a domain's XML says about one run of it: its VMI
// and the VMI names of its NICs and disks by target device.
type domainDevices struct {
	uid    types.UID
	nics   map[string]string
	drives map[string]string
}

func newDomainStats(src DomainStatsSource, node string, vmi func(namespace, name string) *v1.VirtualMachineInstance, log *slog.Logger) *domainStats {
	return &domainStats{src: src, node: node, vmi: vmi, log: log, devices: map[string]*domainDevices{}}
}

// collect is the DomainCollector's source: a failed gathering is logged
// and exposes no per-VMI series.
func (d *domainStats) collect() []DomainStats {
	out, err := d.gather()
	if err != nil {
		d.log.Warn("domain statistics", "err", err)
	}
	return out
}

// gather returns the statistics of every active domain of a VMI of this
// node.
func (d *domainStats) gather() ([]DomainStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	all, err := d.src.AllDomainStats(statsTypes,
		libvirt.CONNECT_GET_ALL_DOMAINS_STATS_ACTIVE|libvirt.CONNECT_GET_ALL_DOMAINS_STATS_NOWAIT)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, s := range all {
			_ = s.Domain.Free()
		}
	}()
	seen := map[string]bool{}
	var out []DomainStats
	for _, s := range all {
		name, err := s.Domain.GetName()
		if err != nil {
			continue // gone meanwhile
		}
		ns, vmiName, ok := domain.SplitName(name)
		if !ok {
			continue
		}
		vmi := d.vmi(ns, vmiName)
		if vmi == nil {
			continue
		}
		devs, key, err := d.devicesOf(s.Domain)
		if err != nil {
			d.log.Debug("domain devices", "domain", name, "err", err)
			continue
		}
		seen[key] = true
		if devs.uid != vmi.UID {
			continue // a domain of that name this VMI does not own
		}
		out = append(out, convert(s, ns, vmiName, d.node, devs))
	}
	for k := range d.devices {
		if !seen[k] {
			delete(d.devices, k)
		}
	}
	return out, nil
}

// devicesOf reads (once per run of the domain) its VMI UID and device
// names from its live XML.
func (d *domainStats) devicesOf(dom *libvirt.Domain) (*domainDevices, string, error) {
	uuid, err := dom.GetUUIDString()
	if err != nil {
		return nil, "", err
	}
	id, err := dom.GetID()
	if err != nil {
		return nil, "", err
	}
	key := fmt.Sprintf("%s/%d", uuid, id)
	if devs, ok := d.devices[key]; ok {
		return devs, key, nil
	}
	doc, err := dom.GetXMLDesc(0)
	if err != nil {
		return nil, "", err
	}
	var x libvirtxml.Domain
	if err := x.Unmarshal(doc); err != nil {
		return nil, "", fmt.Errorf("parse domain xml: %w", err)
	}
	devs := deviceNames(&x)
	if x.Metadata != nil {
		md, ok, err := domain.ParseMetadata(x.Metadata.XML)
		if err != nil {
			return nil, "", err
		}
		if ok {
			devs.uid = types.UID(md.UID)
		}
	}
	d.devices[key] = devs
	return devs, key, nil
}

// deviceNames maps the target devices of a domain's NICs and disks to the
// VMI's names (user aliases ua-<name>); devices without one keep their
// target name.
func deviceNames(x *libvirtxml.Domain) *domainDevices {
	devs := &domainDevices{nics: map[string]string{}, drives: map[string]string{}}
	if x.Devices == nil {
		return devs
	}
	for _, i := range x.Devices.Interfaces {
		if i.Target != nil && i.Alias != nil {
			if name, ok := strings.CutPrefix(i.Alias.Name, "ua-"); ok {
				devs.nics[i.Target.Dev] = name
			}
		}
	}
	for _, k := range x.Devices.Disks {
		if k.Target != nil && k.Alias != nil {
			if name, ok := strings.CutPrefix(k.Alias.Name, "ua-"); ok {
				devs.drives[k.Target.Dev] = name
			}
		}
	}
	return devs
}

// nameOr is names[dev], else dev.
func nameOr(names map[string]string, dev string) string {
	if n, ok := names[dev]; ok {
		return n
	}
	return dev
}

var vcpuStates = map[libvirt.VcpuState]string{
	libvirt.VCPU_OFFLINE: "offline", libvirt.VCPU_RUNNING: "running", libvirt.VCPU_BLOCKED: "blocked",
}

// convert turns libvirt's statistics of one domain into DomainStats.
func convert(s libvirt.DomainStats, namespace, name, node string, devs *domainDevices) DomainStats {
	out := DomainStats{Namespace: namespace, Name: name, Node: node}
	if c := s.Cpu; c != nil {
		out.CPUTime, out.CPUUser, out.CPUSystem = c.Time, c.User, c.System
	}
	for i, v := range s.Vcpu {
		if !v.StateSet && !v.TimeSet {
			continue
		}
		out.VCPUs = append(out.VCPUs, VCPUStats{ID: i, State: vcpuStates[v.State], Time: v.Time, Wait: v.Wait})
	}
	if b := s.Balloon; b != nil {
		out.MemoryAvailable, out.MemoryUnused, out.MemoryUsable = b.Available, b.Unused, b.Usable
		out.MemoryActualBalloon, out.MemoryRSS, out.MemoryDomain = b.Current, b.Rss, b.Maximum
		out.SwapIn, out.SwapOut, out.MajorFaults, out.MinorFaults = b.SwapIn, b.SwapOut, b.MajorFault, b.MinorFault
	}
	for _, n := range s.Net {
		if !n.NameSet {
			continue
		}
		out.Interfaces = append(out.Interfaces, InterfaceStats{Name: nameOr(devs.nics, n.Name),
			RxBytes: n.RxBytes, RxPackets: n.RxPkts, RxErrors: n.RxErrs, RxDropped: n.RxDrop,
			TxBytes: n.TxBytes, TxPackets: n.TxPkts, TxErrors: n.TxErrs, TxDropped: n.TxDrop})
	}
	for _, b := range s.Block {
		if !b.NameSet {
			continue
		}
		out.Blocks = append(out.Blocks, BlockStats{Drive: nameOr(devs.drives, b.Name),
			ReadRequests: b.RdReqs, ReadBytes: b.RdBytes, ReadTime: b.RdTimes,
			WriteRequests: b.WrReqs, WriteBytes: b.WrBytes, WriteTime: b.WrTimes,
			FlushRequests: b.FlReqs, FlushTime: b.FlTimes})
	}
	return out
}
