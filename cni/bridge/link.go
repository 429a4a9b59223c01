package bridge

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"syscall"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// MaxBridgePorts is the kernel's limit of ports on one Linux bridge
// (BR_MAX_PORTS).
const MaxBridgePorts = 1024

// errVLANUnsupported reports a VLAN request the bridge cannot honour.
func errVLANUnsupported(n *NetConf, bridge string, cause error) error {
	what := fmt.Sprintf("vlan=%d", n.VLAN)
	if n.VLAN == 0 {
		what = fmt.Sprintf("vlanTrunk=%v", n.Trunk)
	}
	return types.NewError(types.ErrUnsupportedField,
		fmt.Sprintf("%s: bridge %q cannot filter VLANs on this kernel (%v); refusing to attach without isolation", what, bridge, cause), "")
}

// linkByName returns the link, or nil (and no error) when it does not exist.
func linkByName(h *netlink.Handle, name string) (netlink.Link, error) {
	l, err := h.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil, nil
		}
		return nil, fmt.Errorf("look up link %s: %w", name, err)
	}
	return l, nil
}

// ensureBridgeLocked is ensureBridge under the bridge's file lock, so that
// concurrent attachments agree on creation, promiscuity and VLAN filtering.
// A bridge that already is as the config needs is returned without the
// lock (nothing would change). Per-port work needs no lock: each attachment
// owns its own names.
func ensureBridgeLocked(h *netlink.Handle, n *NetConf, st store) (*netlink.Bridge, error) {
	l, err := linkByName(h, n.Bridge)
	if err != nil {
		return nil, err
	}
	if br, ok := l.(*netlink.Bridge); ok && bridgeReady(br, n) {
		return br, nil
	}
	unlock, err := st.lockBridge(n.Bridge)
	if err != nil {
		return nil, err
	}
	defer unlock()
	return ensureBridge(h, n)
}

// ensureBridge returns the named bridge, creating it (VLAN filtering on when
// the kernel has it) when missing. When the attachment needs VLANs, filtering
// is switched on for an existing bridge too, or a CNI error explains why not.
func ensureBridge(h *netlink.Handle, n *NetConf) (*netlink.Bridge, error) {
	l, err := linkByName(h, n.Bridge)
	if err != nil {
		return nil, err
	}
	if l == nil {
		if err := createBridge(h, n); err != nil {
			return nil, err
		}
		if l, err = h.LinkByName(n.Bridge); err != nil {
			return nil, fmt.Errorf("look up new bridge %s: %w", n.Bridge, err)
		}
	}
	br, ok := l.(*netlink.Bridge)
	if !ok {
		return nil, ConfigError("bridge", "%q exists but is a %s, not a bridge", n.Bridge, l.Type())
	}
	if n.PromiscMode && br.Attrs().Promisc == 0 {
		if err := h.SetPromiscOn(br); err != nil {
			return nil, fmt.Errorf("promiscuous mode on %s: %w", n.Bridge, err)
		}
	}
	if br.Attrs().Flags&netUp == 0 {
		if err := h.LinkSetUp(br); err != nil {
			return nil, fmt.Errorf("set %s up: %w", n.Bridge, err)
		}
	}
	if n.wantsVLANFiltering() && (br.VlanFiltering == nil || !*br.VlanFiltering) {
		if err := setVLANFiltering(br.Attrs().Index); err != nil {
			return nil, errVLANUnsupported(n, n.Bridge, err)
		}
		on := true
		br.VlanFiltering = &on
	}
	return br, nil
}

// bridgeReady reports whether ensureBridge would leave br as it is.
func bridgeReady(br *netlink.Bridge, n *NetConf) bool {
	return br.Attrs().Flags&netUp != 0 &&
		(!n.PromiscMode || br.Attrs().Promisc != 0) &&
		(!n.wantsVLANFiltering() || (br.VlanFiltering != nil && *br.VlanFiltering))
}

func createBridge(h *netlink.Handle, n *NetConf) error {
	on := true
	// A set address keeps the bridge's MAC from following its lowest port.
	mac := make(net.HardwareAddr, 6)
	if _, err := rand.Read(mac); err != nil {
		return fmt.Errorf("bridge MAC: %w", err)
	}
	mac[0] = (mac[0] | 0x02) &^ 0x01
	br := &netlink.Bridge{
		LinkAttrs:     netlink.LinkAttrs{Name: n.Bridge, MTU: n.MTU, TxQLen: -1, Flags: netUp, HardwareAddr: mac},
		VlanFiltering: &on,
	}
	err := h.LinkAdd(br)
	if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.EINVAL) {
		// No CONFIG_BRIDGE_VLAN_FILTERING: an untagged bridge still serves
		// attachments without VLANs; VLAN requests are refused later.
		br.VlanFiltering = nil
		err = h.LinkAdd(br)
	}
	if err != nil && !errors.Is(err, syscall.EEXIST) {
		return fmt.Errorf("create bridge %s: %w", n.Bridge, err)
	}
	return nil
}

// portName derives the host-side veth name from the attachment identity, so
// DEL finds it without the container namespace or a state record.
func portName(network, containerID, ifName string) string {
	sum := sha256.Sum256([]byte(network + "\x00" + containerID + "\x00" + ifName))
	return "nvb" + hex.EncodeToString(sum[:6])
}

// configurePortVLANs puts port on the attachment's VLANs: vlan as the
// untagged PVID, vlanTrunk as tagged, and VLAN 1 removed unless
// preserveDefaultVlan.
func configurePortVLANs(h *netlink.Handle, port netlink.Link, n *NetConf) error {
	if !n.wantsVLANFiltering() {
		return nil
	}
	if n.VLAN != 0 {
		if err := h.BridgeVlanAdd(port, uint16(n.VLAN), true, true, false, true); err != nil {
			return fmt.Errorf("add vlan %d to %s: %w", n.VLAN, port.Attrs().Name, err)
		}
	}
	for _, r := range n.Trunk {
		var err error
		if r.Min == r.Max {
			err = h.BridgeVlanAdd(port, uint16(r.Min), false, false, false, true)
		} else {
			err = h.BridgeVlanAddRange(port, uint16(r.Min), uint16(r.Max), false, false, false, true)
		}
		if err != nil {
			return fmt.Errorf("add trunk vlans %d-%d to %s: %w", r.Min, r.Max, port.Attrs().Name, err)
		}
	}
	if !n.PreserveDefaultVLAN && n.VLAN != 1 && !trunkHas(n.Trunk, 1) {
		if err := h.BridgeVlanDel(port, 1, false, false, false, true); err != nil && !errors.Is(err, syscall.ENOENT) {
			return fmt.Errorf("remove default vlan from %s: %w", port.Attrs().Name, err)
		}
	}
	return nil
}

func trunkHas(t []VLANRange, vid int) bool {
	for _, r := range t {
		if vid >= r.Min && vid <= r.Max {
			return true
		}
	}
	return false
}

// setPortFlags applies hairpin and isolation to a bridge port.
func setPortFlags(h *netlink.Handle, port netlink.Link, n *NetConf) error {
	if n.HairpinMode {
		if err := h.LinkSetHairpin(port, true); err != nil {
			return fmt.Errorf("hairpin on %s: %w", port.Attrs().Name, err)
		}
	}
	if n.PortIsolation {
		if err := h.LinkSetIsolated(port, true); err != nil {
			return fmt.Errorf("isolate port %s: %w", port.Attrs().Name, err)
		}
	}
	return nil
}

// portVLANState describes a port's VLAN membership as the kernel has it.
type portVLANState struct {
	PVID     int
	Untagged map[int]bool
	Tagged   map[int]bool
}

func readPortVLANs(h *netlink.Handle, index int) (*portVLANState, error) {
	all, err := h.BridgeVlanList()
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return nil, fmt.Errorf("list bridge vlans: %w", err)
	}
	s := &portVLANState{Untagged: map[int]bool{}, Tagged: map[int]bool{}}
	var rangeStart int
	for _, v := range all[int32(index)] {
		add := func(vid int) {
			if v.Flags&nl.BRIDGE_VLAN_INFO_PVID != 0 {
				s.PVID = vid
			}
			if v.Flags&nl.BRIDGE_VLAN_INFO_UNTAGGED != 0 {
				s.Untagged[vid] = true
			} else {
				s.Tagged[vid] = true
			}
		}
		switch {
		case v.Flags&nl.BRIDGE_VLAN_INFO_RANGE_BEGIN != 0:
			rangeStart = int(v.Vid)
		case v.Flags&nl.BRIDGE_VLAN_INFO_RANGE_END != 0:
			for vid := rangeStart; vid <= int(v.Vid); vid++ {
				add(vid)
			}
		default:
			add(int(v.Vid))
		}
	}
	return s, nil
}

// checkPortVLANs verifies the port carries exactly what configurePortVLANs set.
func checkPortVLANs(h *netlink.Handle, port netlink.Link, n *NetConf) error {
	if !n.wantsVLANFiltering() {
		return nil
	}
	s, err := readPortVLANs(h, port.Attrs().Index)
	if err != nil {
		return err
	}
	name := port.Attrs().Name
	if n.VLAN != 0 && (s.PVID != n.VLAN || !s.Untagged[n.VLAN]) {
		return fmt.Errorf("port %s: pvid %d, want untagged pvid %d", name, s.PVID, n.VLAN)
	}
	for _, r := range n.Trunk {
		for vid := r.Min; vid <= r.Max; vid++ {
			if !s.Tagged[vid] && vid != n.VLAN {
				return fmt.Errorf("port %s: trunk vlan %d missing", name, vid)
			}
		}
	}
	if !n.PreserveDefaultVLAN && n.VLAN != 1 && !trunkHas(n.Trunk, 1) && (s.Tagged[1] || s.Untagged[1]) {
		return fmt.Errorf("port %s: default vlan 1 present although preserveDefaultVlan is false", name)
	}
	return nil
}

// deleteLink removes the named link; a missing link is success.
func deleteLink(h *netlink.Handle, name string) error {
	l, err := linkByName(h, name)
	if err != nil || l == nil {
		return err
	}
	if err := h.LinkDel(l); err != nil && !errors.Is(err, syscall.ENODEV) {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	return nil
}

// setVLANFiltering turns on VLAN filtering of an existing bridge with a
// message carrying nothing but the flag (as `ip link set type bridge
// vlan_filtering 1` does); echoing the bridge's other attributes back, as
// netlink.BridgeSetVlanFiltering does, makes the kernel answer EBUSY.
func setVLANFiltering(index int) error {
	req := nl.NewNetlinkRequest(unix.RTM_NEWLINK, unix.NLM_F_ACK)
	msg := nl.NewIfInfomsg(unix.AF_UNSPEC)
	msg.Index = int32(index)
	req.AddData(msg)
	info := nl.NewRtAttr(unix.IFLA_LINKINFO, nil)
	info.AddRtAttr(nl.IFLA_INFO_KIND, nl.NonZeroTerminated("bridge"))
	data := info.AddRtAttr(nl.IFLA_INFO_DATA, nil)
	data.AddRtAttr(nl.IFLA_BR_VLAN_FILTERING, []byte{1})
	req.AddData(info)
	_, err := req.Execute(unix.NETLINK_ROUTE, 0)
	return err
}
