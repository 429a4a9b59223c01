package bridge

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Attachment is what AttachTap made: the hypervisor config needs Port (the
// tap, `<interface type='ethernet'><target dev=Port managed='no'/>`), MAC
// and MTU.
type Attachment struct {
	Bridge     string
	Port       string
	MAC        net.HardwareAddr // the VM NIC's MAC (the tap itself gets fe:…)
	MTU        int
	VLAN       int
	Trunk      []VLANRange
	SpoofCheck bool
}

// AttachTap creates (or re-adopts) the persistent tap device `tap`, owned by
// ownerUID (negative: root) so QEMU can open it, and attaches it to the
// config's bridge with its MTU, VLANs, port flags and, when macspoofchk is
// set and mac is given, spoof-check rules pinning mac. It is idempotent: an
// existing tap (a running VM after an agent restart) is reconfigured, not
// replaced. On failure it removes what it made.
func AttachTap(ctx context.Context, conf *NetConf, tap string, mac net.HardwareAddr, ownerUID int) (_ *Attachment, retErr error) {
	if err := validIfName(tap); err != nil {
		return nil, fmt.Errorf("tap name %q: %w", tap, err)
	}
	if conf.MACSpoofCheck && mac == nil {
		return nil, fmt.Errorf("attach %s: macspoofchk needs the NIC's MAC", tap)
	}
	st := store{conf.StateDir}
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
	br, err := ensureBridgeLocked(hh, conf, st)
	if err != nil {
		return nil, err
	}
	l, err := linkByName(hh, tap)
	if err != nil {
		return nil, err
	}
	if l != nil {
		if _, ok := l.(*netlink.Tuntap); !ok {
			return nil, fmt.Errorf("attach %s: exists and is a %s, not a tap", tap, l.Type())
		}
	} else {
		owner := uint32(0)
		if ownerUID > 0 {
			owner = uint32(ownerUID)
		}
		t := &netlink.Tuntap{
			LinkAttrs: netlink.LinkAttrs{Name: tap},
			Mode:      netlink.TUNTAP_MODE_TAP,
			Flags:     netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR,
			Owner:     owner,
		}
		if err := hh.LinkAdd(t); err != nil {
			return nil, fmt.Errorf("create tap %s: %w", tap, err)
		}
		undo.add(func() { _ = deleteLink(hh, tap) })
		if l, err = hh.LinkByName(tap); err != nil {
			return nil, fmt.Errorf("look up tap %s: %w", tap, err)
		}
	}
	if mac != nil {
		// Like libvirt: the host end must never become the bridge's address
		// nor collide with the guest's MAC.
		hostMAC := append(net.HardwareAddr(nil), mac...)
		hostMAC[0] = 0xfe
		if l.Attrs().HardwareAddr.String() != hostMAC.String() {
			if err := hh.LinkSetHardwareAddr(l, hostMAC); err != nil {
				return nil, fmt.Errorf("set MAC of %s: %w", tap, err)
			}
		}
	}
	mtu := conf.MTU
	if mtu == 0 {
		mtu = br.Attrs().MTU
	}
	if l.Attrs().MTU != mtu {
		if err := hh.LinkSetMTU(l, mtu); err != nil {
			return nil, fmt.Errorf("set MTU %d on %s: %w", mtu, tap, err)
		}
	}
	if l.Attrs().MasterIndex != br.Attrs().Index {
		if err := hh.LinkSetMaster(l, br); err != nil {
			return nil, fmt.Errorf("attach %s to %s: %w", tap, conf.Bridge, err)
		}
	}
	if err := configurePortVLANs(hh, l, conf); err != nil {
		return nil, err
	}
	if err := setPortFlags(hh, l, conf); err != nil {
		return nil, err
	}
	if err := hh.LinkSetUp(l); err != nil {
		return nil, fmt.Errorf("set %s up: %w", tap, err)
	}
	if conf.MACSpoofCheck {
		if err := addSpoofRules(tap, mac, "tap/"+tap); err != nil {
			return nil, fmt.Errorf("macspoofchk on %s: %w", tap, err)
		}
		undo.add(func() { _ = delSpoofRules(tap) })
	}
	return &Attachment{
		Bridge: conf.Bridge, Port: tap, MAC: mac, MTU: mtu,
		VLAN: conf.VLAN, Trunk: conf.Trunk, SpoofCheck: conf.MACSpoofCheck,
	}, nil
}

// DetachTap removes the tap and its spoof-check rules. It needs no record
// of the attach: the rules are found by the tap's name (their chain and map
// key derive from it), and removed whatever conf says of macspoofchk, so a
// caller keeps one record of its taps (the node agent's per-VM record) and
// nothing here can disagree with it. A tap that is already gone is success.
func DetachTap(ctx context.Context, conf *NetConf, tap string) error {
	if err := validIfName(tap); err != nil {
		return fmt.Errorf("tap name %q: %w", tap, err)
	}
	rec := &Record{Kind: "tap", Bridge: conf.Bridge, Port: tap}
	rules := func() error {
		if err := delSpoofRulesIfAny(tap); err != nil {
			return fmt.Errorf("remove macspoofchk rules: %w", err)
		}
		return nil
	}
	if err := removeHostSide(ctx, rec, removeInLine, rules); err != nil {
		return fmt.Errorf("detach %s: %w", tap, err)
	}
	// Earlier versions kept a record per tap here; one left behind goes.
	if conf.StateDir != "" {
		old := filepath.Join(conf.StateDir, "tap", tap+".json")
		if err := os.Remove(old); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("detach %s: remove old record: %w", tap, err)
		}
	}
	return nil
}
