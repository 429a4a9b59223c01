package bridge

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"golang.org/x/sys/unix"
)

// hostLocal serves ipam.type "host-local" inside the plugin process instead
// of executing the host-local binary (two process starts per ADD+DEL). It
// keeps host-local's on-disk store exactly, so both can serve one network
// and either can release what the other reserved:
//
//	<dataDir>/<network>/lock                 flock(LOCK_EX) around every change
//	<dataDir>/<network>/<ip>                 "<containerID>\r\n<ifname>"
//	<dataDir>/<network>/last_reserved_ip.<n> last address handed out from range set n
//
// and its allocation order: round robin from the address after the last one
// reserved, across the ranges of a set, skipping the gateway. Configs using
// what this does not implement (requested IPs, resolvConf) go to the binary.
type hostLocal struct {
	dir    string
	sets   [][]ipRange
	routes []*types.Route
}

type ipRange struct {
	subnet     net.IPNet
	start, end net.IP
	gateway    net.IP
}

const (
	hostLocalType     = "host-local"
	defaultIPAMDir    = "/var/lib/cni/networks"
	lastReservedName  = "last_reserved_ip."
	reservationSuffix = "\r\n"
)

type hostLocalRange struct {
	Subnet     string `json:"subnet"`
	RangeStart string `json:"rangeStart,omitempty"`
	RangeEnd   string `json:"rangeEnd,omitempty"`
	Gateway    string `json:"gateway,omitempty"`
}

// nativeHostLocal parses a host-local IPAM config; nil means the config
// needs the binary (another type, requested IPs, resolvConf, or anything it
// would reject, so that the binary reports the error in its own words).
func nativeHostLocal(stdin []byte, envArgs string) *hostLocal {
	var c struct {
		Name string `json:"name"`
		IPAM struct {
			Type string `json:"type"`
			hostLocalRange
			Ranges     [][]hostLocalRange `json:"ranges"`
			Routes     []*types.Route     `json:"routes"`
			DataDir    string             `json:"dataDir"`
			ResolvConf string             `json:"resolvConf"`
		} `json:"ipam"`
		Args struct {
			CNI struct {
				IPs []string `json:"ips"`
			} `json:"cni"`
		} `json:"args"`
		RuntimeConfig struct {
			IPs []string `json:"ips"`
		} `json:"runtimeConfig"`
	}
	if err := json.Unmarshal(stdin, &c); err != nil || c.IPAM.Type != hostLocalType {
		return nil
	}
	if c.IPAM.ResolvConf != "" || len(c.Args.CNI.IPs) > 0 || len(c.RuntimeConfig.IPs) > 0 ||
		strings.Contains(";"+envArgs, ";IP=") || c.Name == "" || checkSafe("network name", c.Name) != nil {
		return nil
	}
	sets := c.IPAM.Ranges
	if c.IPAM.Subnet != "" {
		sets = append([][]hostLocalRange{{c.IPAM.hostLocalRange}}, sets...)
	}
	if len(sets) == 0 {
		return nil
	}
	h := &hostLocal{routes: c.IPAM.Routes}
	var all []ipRange
	for _, set := range sets {
		if len(set) == 0 {
			return nil
		}
		var rs []ipRange
		for _, raw := range set {
			r, ok := parseIPRange(raw)
			if !ok || (len(rs) > 0 && len(r.start) != len(rs[0].start)) {
				return nil
			}
			for _, o := range all {
				if o.subnet.Contains(r.start) || r.subnet.Contains(o.start) {
					return nil // overlapping ranges: host-local's error
				}
			}
			rs = append(rs, r)
			all = append(all, r)
		}
		h.sets = append(h.sets, rs)
	}
	dir := c.IPAM.DataDir
	if dir == "" {
		dir = defaultIPAMDir
	}
	h.dir = filepath.Join(dir, c.Name)
	return h
}

// parseIPRange fills host-local's defaults: start after the network address,
// end before the IPv4 broadcast address, gateway the first address.
func parseIPRange(raw hostLocalRange) (ipRange, bool) {
	_, sn, err := net.ParseCIDR(raw.Subnet)
	if err != nil {
		return ipRange{}, false
	}
	if v4 := sn.IP.To4(); v4 != nil {
		sn.IP = v4
	}
	if ones, bits := sn.Mask.Size(); ones > bits-2 || len(sn.IP) != len(sn.Mask) {
		return ipRange{}, false
	}
	r := ipRange{subnet: *sn, start: nextIP(sn.IP)}
	r.end = make(net.IP, len(sn.IP))
	for i := range sn.IP {
		r.end[i] = sn.IP[i] | ^sn.Mask[i]
	}
	if len(r.end) == net.IPv4len {
		r.end[3]--
	}
	r.gateway = r.start
	for _, f := range []struct {
		s   string
		dst *net.IP
	}{{raw.RangeStart, &r.start}, {raw.RangeEnd, &r.end}, {raw.Gateway, &r.gateway}} {
		if f.s == "" {
			continue
		}
		ip := canonicalIP(net.ParseIP(f.s), len(sn.IP))
		if ip == nil || !sn.Contains(ip) {
			return ipRange{}, false
		}
		*f.dst = ip
	}
	if ipCompare(r.start, r.end) > 0 {
		return ipRange{}, false
	}
	return r, true
}

func canonicalIP(ip net.IP, n int) net.IP {
	if ip == nil {
		return nil
	}
	if n == net.IPv4len {
		return ip.To4()
	}
	return ip.To16()
}

func ipCompare(a, b net.IP) int {
	for i := range a {
		if a[i] != b[i] {
			return int(a[i]) - int(b[i])
		}
	}
	return 0
}

func (r ipRange) contains(ip net.IP) bool {
	ip = canonicalIP(ip, len(r.start))
	return ip != nil && ipCompare(ip, r.start) >= 0 && ipCompare(ip, r.end) <= 0
}

// lock takes host-local's flock on the network's directory.
func (h *hostLocal) lock() (func(), error) {
	if err := os.MkdirAll(h.dir, 0o755); err != nil {
		return nil, fmt.Errorf("host-local store: %w", err)
	}
	unlock, err := flock(filepath.Join(h.dir, "lock"))
	if err != nil {
		return nil, fmt.Errorf("host-local lock: %w", err)
	}
	return unlock, nil
}

// reservations lists the addresses whose file holds owner (or, as files of
// old host-local versions do, only the container ID).
func (h *hostLocal) reservations(containerID, ifName string) ([]string, error) {
	ents, err := os.ReadDir(h.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("host-local store: %w", err)
	}
	id := strings.TrimSpace(containerID)
	owner := id + reservationSuffix + ifName
	var exact, old []string
	for _, e := range ents {
		name := e.Name()
		if e.IsDir() || net.ParseIP(name) == nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(h.dir, name))
		if err != nil {
			continue
		}
		switch strings.TrimSpace(string(b)) {
		case owner:
			exact = append(exact, name)
		case id:
			old = append(old, name)
		}
	}
	if len(exact) > 0 {
		return exact, nil
	}
	return old, nil
}

// add reserves one address from every range set.
func (h *hostLocal) add(containerID, ifName string) (_ *current.Result, retErr error) {
	unlock, err := h.lock()
	if err != nil {
		return nil, err
	}
	defer unlock()
	held, err := h.reservations(containerID, ifName)
	if err != nil {
		return nil, err
	}
	res := &current.Result{CNIVersion: current.ImplementedSpecVersion, Routes: h.routes}
	var made []string
	defer func() {
		if retErr != nil {
			for _, m := range made {
				_ = os.Remove(filepath.Join(h.dir, m))
			}
		}
	}()
	for i, set := range h.sets {
		for _, name := range held {
			for _, r := range set {
				if r.contains(net.ParseIP(name)) {
					return nil, fmt.Errorf("%s has been allocated to %s, duplicate allocation is not allowed", name, containerID)
				}
			}
		}
		ip, r, err := h.reserve(i, set, containerID, ifName)
		if err != nil {
			return nil, err
		}
		made = append(made, ip.String())
		res.IPs = append(res.IPs, &current.IPConfig{
			Address: net.IPNet{IP: ip, Mask: r.subnet.Mask}, Gateway: r.gateway,
		})
	}
	return res, nil
}

// reserve walks set round robin from the address after the last reserved
// one and takes the first address without a reservation file.
func (h *hostLocal) reserve(setIdx int, set []ipRange, containerID, ifName string) (net.IP, ipRange, error) {
	lastFile := filepath.Join(h.dir, lastReservedName+strconv.Itoa(setIdx))
	idx, cur := 0, net.IP(nil)
	if b, err := os.ReadFile(lastFile); err == nil {
		last := net.ParseIP(strings.TrimSpace(string(b)))
		for i, r := range set {
			if last != nil && r.contains(last) {
				idx, cur = i, canonicalIP(last, len(r.start))
				break
			}
		}
	}
	var first net.IP
	for {
		switch {
		case cur == nil:
			cur = set[idx].start
		case cur.Equal(set[idx].end):
			idx = (idx + 1) % len(set)
			cur = set[idx].start
		default:
			cur = nextIP(cur)
		}
		if first == nil {
			first = cur
		} else if cur.Equal(first) {
			var rs []string
			for _, r := range set {
				rs = append(rs, r.start.String()+"-"+r.end.String())
			}
			return nil, ipRange{}, fmt.Errorf("no IP addresses available in range set: %s", strings.Join(rs, ","))
		}
		if cur.Equal(set[idx].gateway) {
			continue
		}
		f, err := os.OpenFile(filepath.Join(h.dir, cur.String()), os.O_RDWR|os.O_EXCL|os.O_CREATE|unix.O_CLOEXEC, 0o644)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return nil, ipRange{}, fmt.Errorf("host-local reserve %s: %w", cur, err)
		}
		_, werr := f.WriteString(strings.TrimSpace(containerID) + reservationSuffix + ifName)
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		if werr == nil {
			werr = os.WriteFile(lastFile, []byte(cur.String()), 0o644)
		}
		if werr != nil {
			_ = os.Remove(f.Name())
			return nil, ipRange{}, fmt.Errorf("host-local reserve %s: %w", cur, werr)
		}
		return cur, set[idx], nil
	}
}

// release removes the attachment's reservations; none is success.
func (h *hostLocal) release(containerID, ifName string) error {
	unlock, err := h.lock()
	if err != nil {
		return err
	}
	defer unlock()
	held, err := h.reservations(containerID, ifName)
	if err != nil {
		return err
	}
	for _, name := range held {
		if err := os.Remove(filepath.Join(h.dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("host-local release %s: %w", name, err)
		}
	}
	return nil
}

// check fails when the attachment holds no reservation.
func (h *hostLocal) check(containerID, ifName string) error {
	unlock, err := h.lock()
	if err != nil {
		return err
	}
	defer unlock()
	held, err := h.reservations(containerID, ifName)
	if err != nil {
		return err
	}
	if len(held) == 0 {
		return fmt.Errorf("host-local: failed to find address added by container %v", containerID)
	}
	return nil
}
