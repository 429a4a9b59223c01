// Package podnet gives VMI interfaces with KubeVirt's masquerade binding on
// the pod network (`networks: [{name: default, pod: {}}]`) a per-node NAT
// network: one Linux bridge holding the gateway address, outbound
// masquerade in an nftables table of its own, and a DHCPv4 server that
// hands every attached MAC a stable address from the node subnet.
//
// KubeVirt gives every guest 10.0.2.2 behind a NAT inside its own pod; here
// one node bridge serves all VMs of the node, so each guest gets its own
// address from a node subnet (10.244.0.0/24 unless configured).
//
// The nodeagent calls Ensure once, runs Run in the background, calls Attach
// for each masquerade interface (the returned tap goes to libvirt as an
// unmanaged ethernet interface), Detach when the VMI goes, and Lease for the
// interface's address in the VMI status.
package podnet

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	// DefaultBridge is the node bridge of the pod network.
	DefaultBridge = "nodevirt0"
	// DefaultCIDR is the node subnet; its first address is the gateway.
	DefaultCIDR = "10.244.0.0/24"
	// DefaultStateDir holds the address allocations and tap records.
	DefaultStateDir = "/var/lib/nodevirt/podnet"
	// DefaultLeaseTime is the DHCP lease handed to guests. Addresses are
	// allocated for the VMI's lifetime, so the lease only paces renewals.
	DefaultLeaseTime = 24 * time.Hour
	// DefaultResolvConf is where the DNS servers for guests are read.
	DefaultResolvConf = "/etc/resolv.conf"

	// forwardMarkDir holds the forwarding marks (see forwardMark).
	forwardMarkDir = "/run/nodevirt/podnet"
	// tablePrefix begins the name of every pod network's nftables tables.
	tablePrefix = "nodevirt_podnet_"
)

// Config describes the node's pod network.
type Config struct {
	// Bridge is the bridge's name (DefaultBridge when empty).
	Bridge string
	// CIDR is the IPv4 node subnet (DefaultCIDR when empty). The first
	// host address is the gateway on the bridge; the rest go to guests.
	CIDR string
	// MTU of the bridge and taps, and the MTU option given to guests;
	// 0 leaves the kernel's default (1500).
	MTU int
	// StateDir holds the allocation file and tap records
	// (DefaultStateDir when empty).
	StateDir string
	// DNS servers given to guests. Empty: the IPv4 nameservers of
	// ResolvConf that guests can reach (not loopback), else the gateway.
	DNS []net.IP
	// ResolvConf is read for DNS servers and search domains
	// (DefaultResolvConf when empty).
	ResolvConf string
	// LeaseTime of DHCP leases (DefaultLeaseTime when zero).
	LeaseTime time.Duration
	// Log receives the network's log lines (slog.Default() when nil).
	Log *slog.Logger
}

// Network is one node's pod network. Its methods are safe for concurrent
// use.
type Network struct {
	bridge    string
	table     string // nftables table name, see TableName
	subnet    *net.IPNet
	gateway   net.IP
	mtu       int
	stateDir  string
	leaseTime time.Duration
	dns       []net.IP
	search    []string
	log       *slog.Logger

	mu     sync.Mutex
	allocs *allocations
}

// New validates cfg, fills in its defaults and loads the persisted address
// allocations. It touches no network state: that is Ensure's job.
func New(cfg Config) (*Network, error) {
	if cfg.Bridge == "" {
		cfg.Bridge = DefaultBridge
	}
	if cfg.CIDR == "" {
		cfg.CIDR = DefaultCIDR
	}
	if cfg.StateDir == "" {
		cfg.StateDir = DefaultStateDir
	}
	if cfg.ResolvConf == "" {
		cfg.ResolvConf = DefaultResolvConf
	}
	if cfg.LeaseTime == 0 {
		cfg.LeaseTime = DefaultLeaseTime
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if len(cfg.Bridge) > 15 || strings.ContainsAny(cfg.Bridge, "/ \t\n\"") {
		return nil, fmt.Errorf("podnet bridge %q: not a valid interface name", cfg.Bridge)
	}
	ip, subnet, err := net.ParseCIDR(cfg.CIDR)
	if err != nil || ip.To4() == nil {
		return nil, fmt.Errorf("podnet cidr %q: not an IPv4 CIDR", cfg.CIDR)
	}
	subnet.IP = subnet.IP.To4()
	if ones, _ := subnet.Mask.Size(); ones > 29 {
		return nil, fmt.Errorf("podnet cidr %q: prefix /%d leaves no room for guests (at most /29)", cfg.CIDR, ones)
	}
	if !ip.Equal(subnet.IP) {
		return nil, fmt.Errorf("podnet cidr %q: host bits set (did you mean %s?)", cfg.CIDR, subnet)
	}
	if cfg.MTU != 0 && (cfg.MTU < 576 || cfg.MTU > 65535) {
		return nil, fmt.Errorf("podnet mtu %d: out of range 576-65535", cfg.MTU)
	}
	if cfg.LeaseTime < time.Minute {
		return nil, fmt.Errorf("podnet lease time %s: below one minute", cfg.LeaseTime)
	}
	for _, d := range cfg.DNS {
		if d.To4() == nil {
			return nil, fmt.Errorf("podnet dns server %s: not IPv4", d)
		}
	}
	n := &Network{
		bridge:    cfg.Bridge,
		table:     TableName(cfg.Bridge),
		subnet:    subnet,
		gateway:   hostAddr(subnet, 1),
		mtu:       cfg.MTU,
		stateDir:  cfg.StateDir,
		leaseTime: cfg.LeaseTime,
		log:       cfg.Log.With("bridge", cfg.Bridge, "cidr", subnet.String()),
	}
	servers, search, err := readResolvConf(cfg.ResolvConf)
	if err != nil {
		return nil, err
	}
	n.search = search
	switch {
	case len(cfg.DNS) > 0:
		n.dns = cfg.DNS
	case len(servers) > 0:
		n.dns = servers
	default:
		n.dns = []net.IP{n.gateway}
	}
	if n.allocs, err = loadAllocations(n.allocPath(), subnet, n.log); err != nil {
		return nil, err
	}
	return n, nil
}

// Bridge is the bridge's name.
func (n *Network) Bridge() string { return n.bridge }

// Gateway is the gateway address guests are given (the bridge's address).
func (n *Network) Gateway() net.IP { return n.gateway }

// Subnet is the node subnet.
func (n *Network) Subnet() *net.IPNet {
	return &net.IPNet{IP: n.subnet.IP, Mask: n.subnet.Mask}
}

func (n *Network) allocPath() string { return filepath.Join(n.stateDir, "allocations.json") }
func (n *Network) tapDir() string    { return filepath.Join(n.stateDir, "taps") }

// forwardMark is the file that says a pod network switched IPv4 forwarding
// on in this network namespace. It is per namespace rather than per
// network, so whichever pod network of the host goes last switches it off
// again, and under /run, so a reboot (which resets the sysctl) forgets it.
func forwardMark() (string, error) {
	fi, err := os.Stat("/proc/thread-self/ns/net")
	if err != nil {
		return "", fmt.Errorf("network namespace: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return "", errors.New("network namespace: no inode")
	}
	return fmt.Sprintf("%s/ip_forward-enabled-%d", forwardMarkDir, st.Ino), nil
}

// hostAddr is the i-th address of subnet.
func hostAddr(subnet *net.IPNet, i uint32) net.IP {
	base := subnet.IP.To4()
	v := uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])
	v += i
	return net.IPv4(byte(v>>24), byte(v>>16), byte(v>>8), byte(v)).To4()
}

// readResolvConf returns the IPv4 nameservers guests can reach (loopback
// resolvers such as systemd-resolved's stub are useless to them) and the
// search domains. A missing file yields nothing.
func readResolvConf(path string) ([]net.IP, []string, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", path, err)
	}
	var servers []net.IP
	var search []string
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) < 2 || strings.HasPrefix(f[0], "#") || strings.HasPrefix(f[0], ";") {
			continue
		}
		switch f[0] {
		case "nameserver":
			if ip := net.ParseIP(f[1]).To4(); ip != nil && !ip.IsLoopback() && !ip.IsUnspecified() {
				servers = append(servers, ip)
			}
		case "search", "domain":
			search = f[1:]
		}
	}
	return servers, search, nil
}
