package podnet

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/cni/bridge"
)

// Ensure makes the node's pod network exist: the bridge up with the gateway
// address, IPv4 forwarding, the nftables table `inet nodevirt_podnet_<bridge>`
// (masquerade of the subnet's traffic leaving the subnet, forward accept for
// it) and the base of `bridge nodevirt_podnet_<bridge>` (per-guest anti-spoofing,
// see nft.go). It is idempotent and repairs what has drifted. It refuses a subnet
// that overlaps an address or route the node already has elsewhere.
func (n *Network) Ensure(ctx context.Context) error {
	if err := n.checkOverlap(); err != nil {
		return err
	}
	br, err := n.ensureBridge()
	if err != nil {
		return err
	}
	if err := n.ensureForwarding(br.Attrs().Name); err != nil {
		return err
	}
	if err := runNFT(ctx, n.nftEnsureScript()); err != nil {
		return fmt.Errorf("podnet nftables tables: %w", err)
	}
	n.log.Info("pod network ready", "gateway", n.gateway)
	return nil
}

// checkOverlap refuses a subnet that collides with another link's address
// or with a route through another link (a cluster's own pod network, a
// VirtualBox NAT, ...): guests would shadow those hosts.
func (n *Network) checkOverlap() error {
	overlaps := func(o *net.IPNet) bool { return o.Contains(n.subnet.IP) || n.subnet.Contains(o.IP) }
	own := 0
	if l, err := netlink.LinkByName(n.bridge); err == nil {
		own = l.Attrs().Index
	}
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("list addresses: %w", err)
	}
	for _, a := range addrs {
		if a.LinkIndex != own && !a.IP.IsLoopback() && overlaps(a.IPNet) {
			return fmt.Errorf("podnet cidr %s overlaps address %s on link %d: choose another subnet", n.subnet, a.IPNet, a.LinkIndex)
		}
	}
	routes, err := netlink.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("list routes: %w", err)
	}
	for _, r := range routes {
		if r.Dst == nil || r.LinkIndex == own {
			continue
		}
		if ones, _ := r.Dst.Mask.Size(); ones == 0 {
			continue
		}
		if overlaps(r.Dst) {
			return fmt.Errorf("podnet cidr %s overlaps route %s on link %d: choose another subnet", n.subnet, r.Dst, r.LinkIndex)
		}
	}
	return nil
}

// ensureBridge creates the bridge when missing (with a fixed random MAC so
// its address does not follow its ports), brings it up and gives it the
// gateway address.
func (n *Network) ensureBridge() (*netlink.Bridge, error) {
	l, err := netlink.LinkByName(n.bridge)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		mac := make(net.HardwareAddr, 6)
		if _, err := rand.Read(mac); err != nil {
			return nil, fmt.Errorf("bridge MAC: %w", err)
		}
		mac[0] = (mac[0] | 0x02) &^ 0x01
		attrs := netlink.LinkAttrs{Name: n.bridge, MTU: n.mtu, TxQLen: -1, HardwareAddr: mac}
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: attrs}); err != nil && !errors.Is(err, syscall.EEXIST) {
			return nil, fmt.Errorf("create bridge %s: %w", n.bridge, err)
		}
		if l, err = netlink.LinkByName(n.bridge); err != nil {
			return nil, fmt.Errorf("look up bridge %s: %w", n.bridge, err)
		}
		n.log.Info("created pod network bridge")
	case err != nil:
		return nil, fmt.Errorf("look up bridge %s: %w", n.bridge, err)
	}
	br, ok := l.(*netlink.Bridge)
	if !ok {
		return nil, fmt.Errorf("podnet bridge %s exists and is a %s, not a bridge", n.bridge, l.Type())
	}
	if n.mtu != 0 && br.Attrs().MTU != n.mtu {
		if err := netlink.LinkSetMTU(br, n.mtu); err != nil {
			return nil, fmt.Errorf("set MTU %d on %s: %w", n.mtu, n.bridge, err)
		}
	}
	gw := &netlink.Addr{IPNet: &net.IPNet{IP: n.gateway, Mask: n.subnet.Mask}}
	if err := netlink.AddrReplace(br, gw); err != nil {
		return nil, fmt.Errorf("address %s on %s: %w", gw.IPNet, n.bridge, err)
	}
	// An address of an earlier configuration (the CIDR changed) goes.
	addrs, err := netlink.AddrList(br, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("list addresses of %s: %w", n.bridge, err)
	}
	for _, a := range addrs {
		if a.IPNet.String() != gw.IPNet.String() {
			if err := netlink.AddrDel(br, &a); err != nil {
				return nil, fmt.Errorf("remove stale address %s from %s: %w", a.IPNet, n.bridge, err)
			}
			n.log.Info("removed stale address from the bridge", "address", a.IPNet)
		}
	}
	if br.Attrs().Flags&net.FlagUp == 0 {
		if err := netlink.LinkSetUp(br); err != nil {
			return nil, fmt.Errorf("set %s up: %w", n.bridge, err)
		}
	}
	return br, nil
}

// ensureForwarding switches on IPv4 forwarding. The replies to masqueraded
// traffic come in on the uplink, so forwarding is needed node-wide
// (net.ipv4.ip_forward), not only on the bridge. When a pod network is the
// one that switched it on it leaves a mark, so the last Teardown of the
// namespace can switch it off again.
func (n *Network) ensureForwarding(bridge string) error {
	cur, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	if err != nil {
		return fmt.Errorf("read net.ipv4.ip_forward: %w", err)
	}
	if strings.TrimSpace(string(cur)) != "1" {
		mark, err := forwardMark()
		if err != nil {
			return err
		}
		if err := os.MkdirAll(forwardMarkDir, 0o700); err != nil {
			return fmt.Errorf("record ip_forward: %w", err)
		}
		if err := os.WriteFile(mark, []byte("net.ipv4.ip_forward was 0 before the nodevirt pod network\n"), 0o600); err != nil {
			return fmt.Errorf("record ip_forward: %w", err)
		}
		if err := writeSysctl("net/ipv4/ip_forward", "1"); err != nil {
			return err
		}
		n.log.Info("enabled net.ipv4.ip_forward")
	}
	return writeSysctl("net/ipv4/conf/"+bridge+"/forwarding", "1")
}

// restoreForwarding switches IPv4 forwarding off again when a pod network
// switched it on and no other pod network of the namespace remains.
func (n *Network) restoreForwarding(ctx context.Context) error {
	mark, err := forwardMark()
	if err != nil {
		return err
	}
	if _, err := os.Stat(mark); err != nil {
		return nil
	}
	others, err := n.otherTables(ctx)
	if err != nil {
		return err
	}
	if len(others) > 0 {
		n.log.Info("left net.ipv4.ip_forward on for the other pod networks", "tables", others)
		return nil
	}
	if err := writeSysctl("net/ipv4/ip_forward", "0"); err != nil {
		return err
	}
	n.log.Info("restored net.ipv4.ip_forward=0")
	if err := os.Remove(mark); err != nil {
		return fmt.Errorf("remove ip_forward mark: %w", err)
	}
	// The directories go when no other namespace's mark is in them.
	_ = os.Remove(forwardMarkDir)
	_ = os.Remove(filepath.Dir(forwardMarkDir))
	return nil
}

// Teardown removes what Ensure and Attach made: the taps still attached,
// the bridge, the nftables tables, IPv4 forwarding if a pod network switched
// it on and this was the namespace's last,
// and the state files. It is for uninstalling (`make lab-down`), not for
// agent shutdown: running guests lose their network. What is already gone
// is success.
func (n *Network) Teardown(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	var errs []error
	taps := map[string]bool{}
	for _, e := range n.allocs.all() {
		taps[e.Tap] = true
	}
	ports, err := n.bridgeTaps()
	if err != nil {
		errs = append(errs, err)
	}
	for _, t := range ports {
		taps[t] = true
	}
	for t := range taps {
		if err := bridge.DetachTap(ctx, n.tapConf(), t); err != nil {
			errs = append(errs, err)
		}
	}
	if l, err := netlink.LinkByName(n.bridge); err == nil {
		if err := netlink.LinkDel(l); err != nil {
			errs = append(errs, fmt.Errorf("delete bridge %s: %w", n.bridge, err))
		}
	}
	if err := runNFT(ctx, n.nftDeleteScript()); err != nil {
		errs = append(errs, fmt.Errorf("delete nftables tables: %w", err))
	}
	if err := n.restoreForwarding(ctx); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return fmt.Errorf("podnet teardown: %w", errors.Join(errs...))
	}
	if err := os.RemoveAll(n.stateDir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove podnet state: %w", err)
	}
	n.allocs, _ = loadAllocations(n.allocPath(), n.subnet, n.log)
	n.log.Info("pod network removed")
	return nil
}

// writeSysctl writes /proc/sys/<key> (key with '/' separators).
func writeSysctl(key, value string) error {
	if err := os.WriteFile(filepath.Join("/proc/sys", key), []byte(value), 0o644); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", strings.ReplaceAll(key, "/", "."), value, err)
	}
	return nil
}

// bridgeTaps lists the taps that are ports of the network's bridge: with
// the allocations, the taps Teardown removes (the kernel, not a second
// record, knows a tap attached just before the agent stopped).
func (n *Network) bridgeTaps() ([]string, error) {
	br, err := netlink.LinkByName(n.bridge)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("look up bridge %s: %w", n.bridge, err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	var out []string
	for _, l := range links {
		if _, tap := l.(*netlink.Tuntap); tap && l.Attrs().MasterIndex == br.Attrs().Index {
			out = append(out, l.Attrs().Name)
		}
	}
	return out, nil
}
