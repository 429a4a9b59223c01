package podnet

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
)

// allocation is one attached interface: its VMI, tap, MAC and address.
type allocation struct {
	VMI string `json:"vmi"`
	Tap string `json:"tap"`
	MAC string `json:"mac"`
	IP  string `json:"ip"`
}

// allocFile is the allocation file's content.
type allocFile struct {
	Subnet      string        `json:"subnet"`
	Allocations []*allocation `json:"allocations"`
}

// allocations maps MACs to addresses of one subnet and keeps them in a file
// (written atomically), so a restarted agent hands the same addresses to the
// guests that still run. The caller serialises access.
type allocations struct {
	path   string
	subnet *net.IPNet
	byMAC  map[string]*allocation
	byIP   map[string]*allocation
}

// loadAllocations reads path; a missing file is an empty table. Entries that
// do not fit subnet (the CIDR was changed) or collide are dropped, logged.
func loadAllocations(path string, subnet *net.IPNet, log *slog.Logger) (*allocations, error) {
	a := &allocations{path: path, subnet: subnet, byMAC: map[string]*allocation{}, byIP: map[string]*allocation{}}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return a, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read allocations: %w", err)
	}
	var f allocFile
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("parse allocations %s: %w", path, err)
	}
	for _, e := range f.Allocations {
		mac, err := net.ParseMAC(e.MAC)
		ip := net.ParseIP(e.IP).To4()
		if err != nil || ip == nil || !a.usable(ip) || a.byIP[ip.String()] != nil || a.byMAC[mac.String()] != nil {
			log.Warn("dropping stale address allocation", "vmi", e.VMI, "mac", e.MAC, "ip", e.IP)
			continue
		}
		e.MAC, e.IP = mac.String(), ip.String()
		a.byMAC[e.MAC] = e
		a.byIP[e.IP] = e
	}
	return a, nil
}

// size is the number of guest addresses: all but network, gateway and
// broadcast.
func (a *allocations) size() uint32 {
	ones, bits := a.subnet.Mask.Size()
	return 1<<(bits-ones) - 3
}

// usable says whether ip is a guest address of the subnet.
func (a *allocations) usable(ip net.IP) bool {
	if !a.subnet.Contains(ip) {
		return false
	}
	off := binary.BigEndian.Uint32(ip.To4()) - binary.BigEndian.Uint32(a.subnet.IP.To4())
	return off >= 2 && off < a.size()+2
}

// get returns the allocation of mac, or nil.
func (a *allocations) get(mac net.HardwareAddr) *allocation {
	return a.byMAC[mac.String()]
}

// assign gives mac an address for vmi's tap: the one it already has, else
// the address its MAC hashes to, else the next free one after that, so a
// MAC that comes back (a restarted VM) usually finds its old address.
func (a *allocations) assign(vmi, tap string, mac net.HardwareAddr) (net.IP, error) {
	key := mac.String()
	if e := a.byMAC[key]; e != nil {
		if e.VMI != vmi || e.Tap != tap {
			old := *e
			e.VMI, e.Tap = vmi, tap
			if err := a.save(); err != nil {
				*e = old
				return nil, err
			}
		}
		return net.ParseIP(e.IP).To4(), nil
	}
	h := fnv.New32a()
	h.Write(mac)
	n := a.size()
	start := h.Sum32() % n
	for i := range n {
		ip := hostAddr(a.subnet, 2+(start+i)%n)
		if a.byIP[ip.String()] != nil {
			continue
		}
		e := &allocation{VMI: vmi, Tap: tap, MAC: key, IP: ip.String()}
		a.byMAC[key], a.byIP[e.IP] = e, e
		if err := a.save(); err != nil {
			delete(a.byMAC, key)
			delete(a.byIP, e.IP)
			return nil, err
		}
		return ip, nil
	}
	return nil, fmt.Errorf("no free address in %s for %s (%d in use)", a.subnet, mac, len(a.byIP))
}

// release drops the allocations of vmi's tap (every tap of vmi when tap is
// empty) and returns them.
func (a *allocations) release(vmi, tap string) ([]*allocation, error) {
	var gone []*allocation
	for _, e := range a.byMAC {
		if e.VMI == vmi && (tap == "" || e.Tap == tap) {
			gone = append(gone, e)
		}
	}
	if len(gone) == 0 {
		return nil, nil
	}
	for _, e := range gone {
		delete(a.byMAC, e.MAC)
		delete(a.byIP, e.IP)
	}
	if err := a.save(); err != nil {
		for _, e := range gone {
			a.byMAC[e.MAC], a.byIP[e.IP] = e, e
		}
		return nil, err
	}
	return gone, nil
}

// all returns the allocations sorted by address.
func (a *allocations) all() []*allocation {
	out := make([]*allocation, 0, len(a.byMAC))
	for _, e := range a.byMAC {
		out = append(out, e)
	}
	slices.SortFunc(out, func(x, y *allocation) int {
		return int(binary.BigEndian.Uint32(net.ParseIP(x.IP).To4())) - int(binary.BigEndian.Uint32(net.ParseIP(y.IP).To4()))
	})
	return out
}

// save writes the table through a temporary file, synced and renamed, so a
// crash leaves either the old or the new table.
func (a *allocations) save() error {
	b, err := json.MarshalIndent(allocFile{Subnet: a.subnet.String(), Allocations: a.all()}, "", "  ")
	if err != nil {
		return fmt.Errorf("encode allocations: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(a.path), 0o700); err != nil {
		return fmt.Errorf("save allocations: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(a.path), ".allocations-*")
	if err != nil {
		return fmt.Errorf("save allocations: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return fmt.Errorf("save allocations: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("save allocations: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("save allocations: %w", err)
	}
	if err := os.Rename(tmp.Name(), a.path); err != nil {
		return fmt.Errorf("save allocations: %w", err)
	}
	return nil
}
