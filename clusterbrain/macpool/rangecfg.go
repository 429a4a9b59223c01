package macpool

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"

	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	cnaov1 "github.com/nodevirt/nodevirt/clusterbrain/api/networkaddons/v1"
)

// Range is an inclusive range of MAC addresses as 48-bit integers.
type Range struct{ Start, End uint64 }

// DefaultRange is kubemacpool's fallback: 02:00:00:00:00:00–02:FF:FF:FF:FF:FF.
var DefaultRange = Range{Start: 0x02_00_00_00_00_00, End: 0x02_FF_FF_FF_FF_FF}

// Size is the number of addresses in r.
func (r Range) Size() uint64 { return r.End - r.Start + 1 }

// Contains reports whether m is in r.
func (r Range) Contains(m uint64) bool { return m >= r.Start && m <= r.End }

func (r Range) String() string { return FormatMAC(r.Start) + "-" + FormatMAC(r.End) }

// ParseRange parses and checks a start/end pair: 48-bit unicast addresses,
// start not after end.
func ParseRange(start, end string) (Range, error) {
	s, err := ParseMAC(start)
	if err != nil {
		return Range{}, fmt.Errorf("range start: %w", err)
	}
	e, err := ParseMAC(end)
	if err != nil {
		return Range{}, fmt.Errorf("range end: %w", err)
	}
	if s > e {
		return Range{}, fmt.Errorf("range start %s is after range end %s", start, end)
	}
	if (s>>40)&1 == 1 || (e>>40)&1 == 1 {
		return Range{}, errors.New("range must hold unicast addresses (first octet even)")
	}
	return Range{Start: s, End: e}, nil
}

// ParseMAC parses a 48-bit MAC address into an integer.
func ParseMAC(s string) (uint64, error) {
	hw, err := net.ParseMAC(strings.TrimSpace(s))
	if err != nil {
		return 0, err
	}
	if len(hw) != 6 {
		return 0, fmt.Errorf("%q is not a 48-bit mac address", s)
	}
	var v uint64
	for _, b := range hw {
		v = v<<8 | uint64(b)
	}
	return v, nil
}

// FormatMAC renders m as lower-case colon-separated hex.
func FormatMAC(m uint64) string {
	hw := make(net.HardwareAddr, 6)
	for i := 5; i >= 0; i-- {
		hw[i] = byte(m)
		m >>= 8
	}
	return hw.String()
}

// rangeSource follows the configured range: NetworkAddonsConfig "cluster"
// spec.kubeMacPool first, then the HyperConverged's
// spec.kubeMacPoolConfiguration, else DefaultRange.
type rangeSource struct {
	nac, hco cache.SharedIndexInformer
	hcoName  string
	changed  func(Range)
}

func newRangeSource(virt *client.Set, namespace, hcoName string, changed func(Range)) *rangeSource {
	rs := &rangeSource{
		nac:     virt.NetworkAddonsConfigs.Informer("", 0, nil),
		hco:     virt.HyperConvergeds.Informer(namespace, 0, nil),
		hcoName: hcoName,
		changed: changed,
	}
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { rs.changed(rs.current()) },
		UpdateFunc: func(any, any) { rs.changed(rs.current()) },
		DeleteFunc: func(any) { rs.changed(rs.current()) },
	}
	_, _ = rs.nac.AddEventHandler(h)
	_, _ = rs.hco.AddEventHandler(h)
	return rs
}

func (rs *rangeSource) run(ctx context.Context) bool {
	go rs.nac.RunWithContext(ctx)
	go rs.hco.RunWithContext(ctx)
	ok := cache.WaitForCacheSync(ctx.Done(), rs.nac.HasSynced, rs.hco.HasSynced)
	rs.changed(rs.current())
	return ok
}

func (rs *rangeSource) current() Range {
	if obj, ok, _ := rs.nac.GetStore().GetByKey("cluster"); ok {
		if kmp := obj.(*cnaov1.NetworkAddonsConfig).Spec.KubeMacPool; kmp != nil && kmp.RangeStart != "" {
			if r, err := ParseRange(kmp.RangeStart, kmp.RangeEnd); err == nil {
				return r
			}
		}
	}
	for _, obj := range rs.hco.GetStore().List() {
		hco := obj.(*hcov1beta1.HyperConverged)
		if hco.Name != rs.hcoName {
			continue
		}
		if c := hco.Spec.KubeMacPoolConfiguration; c != nil && c.RangeStart != nil && c.RangeEnd != nil {
			if r, err := ParseRange(*c.RangeStart, *c.RangeEnd); err == nil {
				return r
			}
		}
	}
	return DefaultRange
}
