package node

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
)

// InternalIP is the address the node publishes as its InternalIP and where
// its endpoints (console, upload, migration) are reached from the brain and
// the other nodes. An explicit address (the --node-ip flag) wins; it must be
// one of the node's own. Otherwise it is the first IPv4 address of the
// interface that holds the default route, else the first global IPv4
// address of any interface that is up. Loopback is never chosen: another
// host cannot reach it.
func InternalIP(explicit string) (net.IP, error) {
	if explicit != "" {
		ip := net.ParseIP(explicit)
		if ip == nil || ip.To4() == nil {
			return nil, fmt.Errorf("node ip %q is not an ipv4 address", explicit)
		}
		if ip.IsLoopback() || ip.IsUnspecified() {
			return nil, fmt.Errorf("node ip %s is not reachable from other hosts", ip)
		}
		if !hasAddress(ip) {
			return nil, fmt.Errorf("node ip %s is not an address of this host", ip)
		}
		return ip.To4(), nil
	}
	if name := defaultRouteInterface("/proc/net/route"); name != "" {
		if ifc, err := net.InterfaceByName(name); err == nil {
			if ip := firstGlobalIPv4(ifc); ip != nil {
				return ip, nil
			}
		}
	}
	ifaces, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	for i := range ifaces {
		if ifaces[i].Flags&net.FlagUp == 0 || ifaces[i].Flags&net.FlagLoopback != 0 {
			continue
		}
		if ip := firstGlobalIPv4(&ifaces[i]); ip != nil {
			return ip, nil
		}
	}
	return nil, errors.New("no global ipv4 address on this host: give the node's address with --node-ip")
}

func firstGlobalIPv4(ifc *net.Interface) net.IP {
	addrs, err := ifc.Addrs()
	if err != nil {
		return nil
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
			return n.IP.To4()
		}
	}
	return nil
}

func hasAddress(ip net.IP) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
			return true
		}
	}
	return false
}

// defaultRouteInterface reads the kernel's IPv4 routing table (the
// /proc/net/route format) for the interface of the default route; "" when
// there is none.
func defaultRouteInterface(file string) string {
	f, err := os.Open(file)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		// Iface Destination Gateway Flags RefCnt Use Metric Mask ...
		if len(fields) >= 8 && fields[1] == "00000000" && fields[7] == "00000000" {
			return fields[0]
		}
	}
	return ""
}
