package bridge

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// ErrPluginNotAvailable is the STATUS error code for "cannot service ADD".
const ErrPluginNotAvailable uint = 50

// CmdDel removes everything ADD made for the attachment. It needs neither
// the container netns nor a state record: the port name derives from the
// attachment, and removing the host end of the veth removes the pair.
func CmdDel(args *skel.CmdArgs) error {
	n, err := LoadNetConf(args.StdinData, args.Args)
	if err != nil {
		return err
	}
	return del(context.Background(), n, args, helperUnlessBusy(store{n.StateDir}))
}

// Del is CmdDel on a parsed config, for callers that live on after it: the
// port is deleted in line.
func Del(ctx context.Context, n *NetConf, args *skel.CmdArgs) error {
	return del(ctx, n, args, removeInLine)
}

func del(ctx context.Context, n *NetConf, args *skel.CmdArgs, remove linkRemover) error {
	st := store{n.StateDir}
	recPath, err := st.attachmentPath(n.Name, args.ContainerID, args.IfName)
	if err != nil {
		return types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(), "")
	}
	rec, err := st.read(recPath)
	if err != nil {
		return err
	}
	if rec == nil {
		// No record (ADD never got far, or an older DEL finished): act on
		// what the config says ADD would have made.
		rec = &Record{Kind: "veth", Network: n.Name, ContainerID: args.ContainerID, IfName: args.IfName,
			Bridge: n.Bridge, Port: portName(n.Name, args.ContainerID, args.IfName)}
		if n.MACSpoofCheck {
			rec.SpoofChain = spoofChainName(rec.Port)
		}
		if n.IPMasq {
			rec.MasqChain = masqChainName(attachmentTag(n.Name, args.ContainerID, args.IfName))
			if n.PrevResult != nil {
				if prev, err := current.NewResultFromResult(n.PrevResult); err == nil {
					for _, ip := range prev.IPs {
						rec.MasqIPs = append(rec.MasqIPs, ip.Address.IP.String())
					}
				}
			}
		}
	}
	// The IPAM release runs while the port is being removed.
	releaseIPAM := func() error {
		if n.IPAM.Type == "" {
			return nil
		}
		im, err := newIPAM(n.IPAM.Type)
		if err != nil {
			return err
		}
		stdin, conf := args.StdinData, n
		if len(rec.IPAMConfig) > 0 {
			stdin, conf = rec.IPAMConfig, nil
		}
		im.serveNative(stdin, args.Args, args.ContainerID, args.IfName)
		return im.run(ctx, "DEL", stdin, conf, nil)
	}
	if err := removeHostSide(ctx, rec, remove, releaseIPAM); err != nil {
		return err
	}
	return st.remove(recPath)
}

// removeHostSide removes a record's port and nft chains before returning,
// so that nothing of the attachment remains when DEL answers. meanwhile
// (if set) runs while the port is being removed.
func removeHostSide(ctx context.Context, rec *Record, remove linkRemover, meanwhile func() error) error {
	hh, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer hh.Close()
	removed := remove(hh, rec.Port)
	var errs []error
	if meanwhile != nil {
		if err := meanwhile(); err != nil {
			errs = append(errs, err)
		}
	}
	if rec.SpoofChain != "" {
		if err := delSpoofRules(rec.Port); err != nil {
			errs = append(errs, fmt.Errorf("remove macspoofchk rules: %w", err))
		}
	}
	if rec.MasqChain != "" {
		tag := attachmentTag(rec.Network, rec.ContainerID, rec.IfName)
		if err := delMasqRules(tag, ipsOf(rec.MasqIPs)); err != nil {
			errs = append(errs, fmt.Errorf("remove ipMasq rules: %w", err))
		}
	}
	if err := removed(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// CmdCheck verifies the attachment against the kernel: bridge, port and
// its VLANs, the container interface and its addresses, the nft rules, and
// the IPAM plugin's own CHECK.
func CmdCheck(args *skel.CmdArgs) error {
	n, err := LoadNetConf(args.StdinData, args.Args)
	if err != nil {
		return err
	}
	return Check(context.Background(), n, args)
}

// Check is CmdCheck on a parsed config.
func Check(ctx context.Context, n *NetConf, args *skel.CmdArgs) error {
	if n.PrevResult == nil {
		return ConfigError("prevResult", "CHECK needs the result of ADD")
	}
	prev, err := current.NewResultFromResult(n.PrevResult)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, fmt.Sprintf("prevResult: %v", err), "")
	}
	if n.IPAM.Type != "" {
		im, err := newIPAM(n.IPAM.Type)
		if err != nil {
			return err
		}
		im.serveNative(args.StdinData, args.Args, args.ContainerID, args.IfName)
		if err := im.run(ctx, "CHECK", args.StdinData, n, nil); err != nil {
			return err
		}
	}
	st := store{n.StateDir}
	recPath, err := st.attachmentPath(n.Name, args.ContainerID, args.IfName)
	if err != nil {
		return types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(), "")
	}
	rec, err := st.read(recPath)
	if err != nil {
		return err
	}
	if rec == nil {
		return fmt.Errorf("check: no state recorded for %s", attachmentTag(n.Name, args.ContainerID, args.IfName))
	}
	hh, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer hh.Close()
	brl, err := linkByName(hh, n.Bridge)
	if err != nil {
		return err
	}
	if _, ok := brl.(*netlink.Bridge); !ok {
		return fmt.Errorf("check: bridge %s is missing", n.Bridge)
	}
	port, err := linkByName(hh, rec.Port)
	if err != nil {
		return err
	}
	if port == nil {
		return fmt.Errorf("check: port %s is missing", rec.Port)
	}
	if port.Attrs().MasterIndex != brl.Attrs().Index {
		return fmt.Errorf("check: port %s is not attached to bridge %s", rec.Port, n.Bridge)
	}
	if port.Attrs().Flags&netUp == 0 {
		return fmt.Errorf("check: port %s is down", rec.Port)
	}
	if err := checkPortVLANs(hh, port, n); err != nil {
		return fmt.Errorf("check: %w", err)
	}
	mac, err := checkContainer(args, port, prev, n)
	if err != nil {
		return fmt.Errorf("check: %w", err)
	}
	if n.MACSpoofCheck {
		if err := checkSpoofRules(rec.Port, mac); err != nil {
			return fmt.Errorf("check: %w", err)
		}
	}
	return nil
}

func checkContainer(args *skel.CmdArgs, port netlink.Link, prev *current.Result, n *NetConf) (net.HardwareAddr, error) {
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
	cont, err := linkByName(ch, args.IfName)
	if err != nil {
		return nil, err
	}
	if cont == nil {
		return nil, fmt.Errorf("container interface %s is missing", args.IfName)
	}
	if _, ok := cont.(*netlink.Veth); !ok || cont.Attrs().ParentIndex != port.Attrs().Index {
		return nil, fmt.Errorf("container interface %s is not the peer of port %s", args.IfName, port.Attrs().Name)
	}
	mac := cont.Attrs().HardwareAddr
	for _, itf := range prev.Interfaces {
		if itf.Name == args.IfName && itf.Sandbox != "" && itf.Mac != "" && itf.Mac != mac.String() {
			return nil, fmt.Errorf("container interface %s has MAC %s, ADD gave %s", args.IfName, mac, itf.Mac)
		}
	}
	if n.MAC != nil && n.MAC.String() != mac.String() {
		return nil, fmt.Errorf("container interface %s has MAC %s, config asks %s", args.IfName, mac, n.MAC)
	}
	if n.DisableContainerInterface {
		return mac, nil
	}
	if cont.Attrs().Flags&netUp == 0 {
		return nil, fmt.Errorf("container interface %s is down", args.IfName)
	}
	addrs, err := ch.AddrList(cont, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses of %s: %w", args.IfName, err)
	}
	for _, ip := range prev.IPs {
		found := slices.ContainsFunc(addrs, func(a netlink.Addr) bool {
			return a.IPNet.String() == ip.Address.String()
		})
		if !found {
			return nil, fmt.Errorf("container interface %s lacks address %s", args.IfName, ip.Address.String())
		}
	}
	return mac, nil
}

// CmdStatus reports whether ADD can be served: the state directory is
// usable, nftables answers when the config needs it, and the IPAM plugin is
// ready.
func CmdStatus(args *skel.CmdArgs) error {
	n, err := LoadNetConf(args.StdinData, args.Args)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(n.StateDir, 0o700); err != nil {
		return types.NewError(ErrPluginNotAvailable, fmt.Sprintf("state dir %s: %v", n.StateDir, err), "")
	}
	if n.MACSpoofCheck || n.IPMasq {
		if err := nftablesUsable(); err != nil {
			return types.NewError(ErrPluginNotAvailable, err.Error(), "")
		}
	}
	if n.IPAM.Type != "" {
		im, err := newIPAM(n.IPAM.Type)
		if err != nil {
			return types.NewError(ErrPluginNotAvailable, err.Error(), "")
		}
		// An IPAM plugin older than 1.1.0 has no STATUS; finding it on
		// CNI_PATH is all that can be checked.
		ctx := context.Background()
		if im.speaks(ctx, n.CNIVersion) {
			err = invoke.ExecPluginWithoutResult(ctx, im.path, args.StdinData, &invoke.DelegateArgs{Command: "STATUS"}, nil)
			if err != nil {
				return types.NewError(ErrPluginNotAvailable, fmt.Sprintf("ipam %s: %v", n.IPAM.Type, err), "")
			}
		}
	}
	return nil
}

// CmdGC removes attachments of this network that are not in
// cni.dev/valid-attachments (ports, VLAN entries, nft rules, IPAM
// reservations), then forwards GC to the IPAM plugin.
func CmdGC(args *skel.CmdArgs) error {
	n, err := LoadNetConf(args.StdinData, args.Args)
	if err != nil {
		return err
	}
	return GC(context.Background(), n, args.StdinData)
}

// GC is CmdGC on a parsed config.
func GC(ctx context.Context, n *NetConf, stdin []byte) error {
	st := store{n.StateDir}
	valid := map[types.GCAttachment]bool{}
	for _, a := range n.ValidAttachments {
		valid[a] = true
	}
	recs, err := st.networkRecords(n.Name)
	if err != nil {
		return err
	}
	var errs []error
	for path, rec := range recs {
		if valid[types.GCAttachment{ContainerID: rec.ContainerID, IfName: rec.IfName}] {
			continue
		}
		var recErrs []error
		if rec.IPAMType != "" && len(rec.IPAMConfig) > 0 {
			im, err := newIPAM(rec.IPAMType)
			if err == nil {
				im.serveNative(rec.IPAMConfig, "", rec.ContainerID, rec.IfName)
				args := &invoke.Args{Command: "DEL", ContainerID: rec.ContainerID, IfName: rec.IfName,
					Path: os.Getenv("CNI_PATH")}
				err = im.run(ctx, "DEL", rec.IPAMConfig, nil, args)
			}
			if err != nil {
				recErrs = append(recErrs, err)
			}
		}
		if err := removeHostSide(ctx, rec, removeInLine, nil); err != nil {
			recErrs = append(recErrs, err)
		}
		if len(recErrs) == 0 {
			recErrs = append(recErrs, st.remove(path))
		}
		errs = append(errs, recErrs...)
	}
	if n.IPAM.Type != "" {
		// An IPAM plugin older than 1.1.0 has no GC; the per-attachment
		// DELs above released what it held for stale attachments.
		if im, err := newIPAM(n.IPAM.Type); err == nil && im.speaks(ctx, n.CNIVersion) {
			err := invoke.ExecPluginWithoutResult(ctx, im.path, stdin, &invoke.DelegateArgs{Command: "GC"}, nil)
			if err != nil {
				errs = append(errs, fmt.Errorf("ipam %s GC: %w", n.IPAM.Type, err))
			}
		}
	}
	return errors.Join(errs...)
}
