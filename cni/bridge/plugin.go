package bridge

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Funcs are the plugin verbs for skel.PluginMainFuncs.
var Funcs = skel.CNIFuncs{Add: CmdAdd, Del: CmdDel, Check: CmdCheck, Status: CmdStatus, GC: CmdGC}

// VersionInfo lists the spec versions the plugin speaks (0.1.0 … 1.1.0).
var VersionInfo = version.All

// About is printed when the binary runs without CNI_COMMAND.
const About = "nodevirt linux-bridge CNI plugin (cnv-bridge)"

const netUp = net.FlagUp

// revert is an undo list for multi-step setup, run newest first.
type revert []func()

func (r *revert) add(f func()) { *r = append(*r, f) }

func (r revert) run() {
	for i := len(r) - 1; i >= 0; i-- {
		r[i]()
	}
}

func attachmentTag(network, containerID, ifName string) string {
	return network + "/" + containerID + "/" + ifName
}

// CmdAdd attaches a veth in the container netns to the bridge and prints the
// result in the config's cniVersion.
func CmdAdd(args *skel.CmdArgs) error {
	n, err := LoadNetConf(args.StdinData, args.Args)
	if err != nil {
		return err
	}
	res, err := Add(context.Background(), n, args)
	if err != nil {
		return err
	}
	return types.PrintResult(res, n.CNIVersion)
}

// Add is CmdAdd without printing.
func Add(ctx context.Context, n *NetConf, args *skel.CmdArgs) (_ *current.Result, retErr error) {
	if err := validIfName(args.IfName); err != nil {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("CNI_IFNAME %q: %v", args.IfName, err), "")
	}
	st := store{n.StateDir}
	recPath, err := st.attachmentPath(n.Name, args.ContainerID, args.IfName)
	if err != nil {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(), "")
	}
	cns, err := netns.GetFromPath(args.Netns)
	if err != nil {
		return nil, types.NewError(types.ErrInvalidNetNS, fmt.Sprintf("open netns %q: %v", args.Netns, err), "")
	}
	defer cns.Close()
	ch, err := netlink.NewHandleAt(cns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink in container netns: %w", err)
	}
	defer ch.Close()
	hh, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	defer hh.Close()

	var undo revert
	defer func() {
		if retErr != nil {
			undo.run()
		}
	}()

	tag := attachmentTag(n.Name, args.ContainerID, args.IfName)
	rec := &Record{
		Kind: "veth", Network: n.Name, ContainerID: args.ContainerID, IfName: args.IfName,
		Netns: args.Netns, Bridge: n.Bridge, Port: portName(n.Name, args.ContainerID, args.IfName),
		VLAN: n.VLAN, Trunk: n.Trunk,
	}
	if n.IPAM.Type != "" {
		// Recorded before the allocation, so that GC releases it whatever
		// happens to this process.
		rec.IPAMType, rec.IPAMConfig = n.IPAM.Type, args.StdinData
	}
	br, port, cont, err := attachVeth(ctx, hh, ch, cns, n, st, recPath, rec, &undo)
	if err != nil {
		return nil, err
	}

	result := &current.Result{
		CNIVersion: current.ImplementedSpecVersion,
		Interfaces: []*current.Interface{
			{Name: br.Attrs().Name, Mac: br.Attrs().HardwareAddr.String()},
			{Name: port.Attrs().Name, Mac: port.Attrs().HardwareAddr.String()},
			{Name: cont.Attrs().Name, Mac: cont.Attrs().HardwareAddr.String(), Sandbox: args.Netns},
		},
	}
	if n.IPAM.Type == "" {
		return result, nil
	}

	im, err := newIPAM(n.IPAM.Type)
	if err != nil {
		return nil, err
	}
	im.serveNative(args.StdinData, args.Args, args.ContainerID, args.IfName)
	ipres, ipamStdin, err := im.add(ctx, args.StdinData, n)
	if err != nil {
		return nil, err
	}
	undo.add(func() { _ = im.run(ctx, "DEL", ipamStdin, nil, nil) })
	if !bytes.Equal(ipamStdin, rec.IPAMConfig) {
		// The plugin took a downgraded config: GC must hand it the same.
		rec.IPAMConfig = ipamStdin
		if err := st.write(recPath, rec); err != nil {
			return nil, err
		}
	}
	result.IPs, result.Routes, result.DNS = ipres.IPs, ipres.Routes, ipres.DNS
	gws := gateways(result, n)

	if !n.DisableContainerInterface {
		if err := configureContainer(ch, cont, result, n); err != nil {
			return nil, err
		}
	}
	if n.IsGateway {
		if err := setupGateway(hh, br, gws); err != nil {
			return nil, err
		}
	}
	if n.IPMasq {
		var addrs []*net.IPNet
		for _, ip := range result.IPs {
			a := ip.Address
			addrs = append(addrs, &a)
			rec.MasqIPs = append(rec.MasqIPs, a.IP.String())
		}
		rec.MasqChain = masqChainName(tag)
		if err := addMasqRules(tag, addrs); err != nil {
			return nil, fmt.Errorf("ipMasq: %w", err)
		}
		undo.add(func() { _ = delMasqRules(tag, ipsOf(rec.MasqIPs)) })
		if err := st.write(recPath, rec); err != nil {
			return nil, err
		}
	}
	return result, nil
}

// attachVeth does the host-side work: bridge (under the bridge lock), veth
// pair (peer created directly in the container netns), port flags, VLANs,
// spoof-check rules, and the state record.
func attachVeth(ctx context.Context, hh, ch *netlink.Handle, cns netns.NsHandle, n *NetConf, st store, recPath string, rec *Record, undo *revert) (*netlink.Bridge, netlink.Link, netlink.Link, error) {
	br, err := ensureBridgeLocked(hh, n, st)
	if err != nil {
		return nil, nil, nil, err
	}
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{
			Name: rec.Port, MTU: n.MTU, TxQLen: -1, MasterIndex: br.Attrs().Index, Flags: netUp,
		},
		PeerName:         rec.IfName,
		PeerHardwareAddr: n.MAC,
		PeerNamespace:    netlink.NsFd(int(cns)),
		PeerMTU:          uint32(n.MTU),
	}
	err = hh.LinkAdd(veth)
	if errors.Is(err, syscall.EEXIST) {
		// A port of an earlier ADD of this very attachment is stale:
		// replace it (its peer goes with it). Otherwise the name taken is
		// the container's.
		stale, lerr := linkByName(hh, rec.Port)
		if lerr != nil {
			return nil, nil, nil, lerr
		}
		if stale == nil {
			return nil, nil, nil, fmt.Errorf("create veth: interface %q already exists in the container netns", rec.IfName)
		}
		if err := deleteLink(hh, rec.Port); err != nil {
			return nil, nil, nil, err
		}
		err = hh.LinkAdd(veth)
	}
	if err != nil {
		return nil, nil, nil, fmt.Errorf("create veth %s/%s: %w", rec.Port, rec.IfName, err)
	}
	undo.add(func() { _ = deleteLink(hh, rec.Port) })
	port, err := hh.LinkByName(rec.Port)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("look up port %s: %w", rec.Port, err)
	}
	if err := configurePortVLANs(hh, port, n); err != nil {
		return nil, nil, nil, err
	}
	if err := setPortFlags(hh, port, n); err != nil {
		return nil, nil, nil, err
	}
	cont, err := ch.LinkByName(rec.IfName)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("look up container interface %s: %w", rec.IfName, err)
	}
	// As the reference plugin: the container end is up after ADD, with or
	// without IPAM, unless the config asks to leave it down.
	if !n.DisableContainerInterface {
		if err := ch.LinkSetUp(cont); err != nil {
			return nil, nil, nil, fmt.Errorf("set %s up: %w", rec.IfName, err)
		}
	}
	rec.MAC = cont.Attrs().HardwareAddr.String()
	if n.MACSpoofCheck {
		rec.SpoofChain = spoofChainName(rec.Port)
		if err := addSpoofRules(rec.Port, cont.Attrs().HardwareAddr, attachmentTag(rec.Network, rec.ContainerID, rec.IfName)); err != nil {
			return nil, nil, nil, fmt.Errorf("macspoofchk: %w", err)
		}
		undo.add(func() { _ = delSpoofRules(rec.Port) })
	}
	if err := st.write(recPath, rec); err != nil {
		return nil, nil, nil, err
	}
	undo.add(func() { _ = st.remove(recPath) })
	return br, port, cont, nil
}

// gateways fills in gateway addresses (isGateway) and the default route
// (isDefaultGateway); it returns the bridge addresses to set.
func gateways(res *current.Result, n *NetConf) []*net.IPNet {
	var gws []*net.IPNet
	haveDefault := map[bool]bool{}
	for _, r := range res.Routes {
		if ones, _ := r.Dst.Mask.Size(); ones == 0 && r.GW != nil {
			haveDefault[r.Dst.IP.To4() != nil] = true
		}
	}
	for _, ip := range res.IPs {
		ip.Interface = current.Int(2)
		v4 := ip.Address.IP.To4() != nil
		if ip.Gateway == nil && n.IsGateway {
			ip.Gateway = nextIP(ip.Address.IP.Mask(ip.Address.Mask))
		}
		if n.IsGateway {
			gws = append(gws, &net.IPNet{IP: ip.Gateway, Mask: ip.Address.Mask})
		}
		if n.IsDefaultGateway && !haveDefault[v4] {
			dst := net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
			if v4 {
				dst = net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
			}
			res.Routes = append(res.Routes, &types.Route{Dst: dst, GW: ip.Gateway})
			haveDefault[v4] = true
		}
	}
	return gws
}

func nextIP(ip net.IP) net.IP {
	out := make(net.IP, len(ip))
	copy(out, ip)
	for i := len(out) - 1; i >= 0; i-- {
		out[i]++
		if out[i] != 0 {
			break
		}
	}
	return out
}

// configureContainer gives the (already up) container interface the IPAM
// addresses and routes. IPv6 addresses skip DAD unless enabledad.
func configureContainer(ch *netlink.Handle, cont netlink.Link, res *current.Result, n *NetConf) error {
	for _, ip := range res.IPs {
		a := &netlink.Addr{IPNet: &net.IPNet{IP: ip.Address.IP, Mask: ip.Address.Mask}}
		if ip.Address.IP.To4() == nil && !n.EnableDAD {
			a.Flags = unix.IFA_F_NODAD
		}
		if err := ch.AddrAdd(cont, a); err != nil && !errors.Is(err, syscall.EEXIST) {
			return fmt.Errorf("add address %s to %s: %w", a.IPNet, cont.Attrs().Name, err)
		}
	}
	for _, r := range res.Routes {
		dst := r.Dst
		rt := &netlink.Route{LinkIndex: cont.Attrs().Index, Dst: &dst, Gw: r.GW}
		if r.MTU > 0 {
			rt.MTU = r.MTU
		}
		if err := ch.RouteAdd(rt); err != nil && !errors.Is(err, syscall.EEXIST) {
			return fmt.Errorf("add route %s via %s: %w", dst.String(), r.GW, err)
		}
	}
	return nil
}

// setupGateway puts the gateway addresses on the bridge and turns on
// forwarding in the host namespace.
func setupGateway(hh *netlink.Handle, br *netlink.Bridge, gws []*net.IPNet) error {
	v4, v6 := false, false
	for _, gw := range gws {
		a := &netlink.Addr{IPNet: gw}
		if gw.IP.To4() == nil {
			a.Flags = unix.IFA_F_NODAD
			v6 = true
		} else {
			v4 = true
		}
		if err := hh.AddrAdd(br, a); err != nil && !errors.Is(err, syscall.EEXIST) {
			return fmt.Errorf("add gateway %s to %s: %w", gw, br.Attrs().Name, err)
		}
	}
	if v4 {
		if err := writeSysctl("net/ipv4/ip_forward", "1"); err != nil {
			return err
		}
	}
	if v6 {
		if err := writeSysctl("net/ipv6/conf/all/forwarding", "1"); err != nil {
			return err
		}
	}
	return nil
}

func ipsOf(ss []string) []net.IP {
	var out []net.IP
	for _, s := range ss {
		if ip := net.ParseIP(s); ip != nil {
			out = append(out, ip)
		}
	}
	return out
}
