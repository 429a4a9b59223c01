package podnet

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/cni/bridge"
)

// tapConf is the cni/bridge config for taps on the pod network bridge: no
// VLANs, the bridge's MTU, the bridge lock in the network's own state dir.
func (n *Network) tapConf() *bridge.NetConf {
	return &bridge.NetConf{
		Bridge:              n.bridge,
		MTU:                 n.mtu,
		PreserveDefaultVLAN: true,
		StateDir:            n.tapDir(),
	}
}

// Attach creates (or re-adopts, after an agent restart) the persistent tap
// `tap` on the bridge, owned by ownerUID (negative: root) so QEMU can open
// it, and allocates mac an address, the same one across agent restarts. It
// returns what the tap attach made (device, MAC, MTU: what the domain's
// NIC needs) and the address.
// vmiKey names the VMI ("namespace/name", optionally more: "/uid"); its
// name part becomes the hostname the DHCP server offers. From now on the
// DHCP server answers mac. Ensure must have run. On failure nothing is
// left behind that was not there before.
//
// libvirt gets the tap as `<interface type='ethernet'><target dev=tap
// managed='no'/><mac address=mac/>`.
func (n *Network) Attach(ctx context.Context, vmiKey, tap string, mac net.HardwareAddr, ownerUID int) (_ *bridge.Attachment, _ net.IP, retErr error) {
	if len(mac) != 6 {
		return nil, nil, fmt.Errorf("attach %s to pod network: MAC %q is not an Ethernet MAC", vmiKey, mac)
	}
	if mac[0]&1 != 0 {
		return nil, nil, fmt.Errorf("attach %s to pod network: MAC %s is multicast", vmiKey, mac)
	}
	if vmiKey == "" {
		return nil, nil, errors.New("attach to pod network: empty VMI key")
	}
	if _, err := netlink.LinkByName(n.bridge); err != nil {
		return nil, nil, fmt.Errorf("attach %s to pod network: bridge %s: %w (Ensure not run?)", vmiKey, n.bridge, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	_, lookupErr := netlink.LinkByName(tap)
	existed := lookupErr == nil // a re-adopted tap belongs to a running guest
	att, err := bridge.AttachTap(ctx, n.tapConf(), tap, mac, ownerUID)
	if err != nil {
		return nil, nil, fmt.Errorf("attach %s to pod network: %w", vmiKey, err)
	}
	defer func() {
		if retErr != nil && !existed {
			_ = bridge.DetachTap(ctx, n.tapConf(), tap)
		}
	}()
	isNew := n.allocs.get(mac) == nil
	ip, err := n.allocs.assign(vmiKey, tap, mac)
	if err != nil {
		return nil, nil, fmt.Errorf("attach %s to pod network: %w", vmiKey, err)
	}
	if err := runNFT(ctx, n.nftGuardScript(tap, mac, ip)); err != nil {
		if isNew {
			_, _ = n.allocs.release(vmiKey, tap)
		}
		return nil, nil, fmt.Errorf("attach %s to pod network: anti-spoofing rules for %s: %w", vmiKey, tap, err)
	}
	n.log.Info("attached to pod network", "vmi", vmiKey, "tap", tap, "mac", mac.String(), "ip", ip)
	return att, ip, nil
}

// Detach removes the tap and releases the addresses vmiKey's tap held (all
// of vmiKey's when tap is empty). What is already gone is success.
func (n *Network) Detach(ctx context.Context, vmiKey, tap string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	taps := map[string]bool{}
	if tap != "" {
		taps[tap] = true
	}
	for _, e := range n.allocs.all() {
		if e.VMI == vmiKey && (tap == "" || e.Tap == tap) {
			taps[e.Tap] = true
		}
	}
	for t := range taps {
		if err := runNFT(ctx, n.nftUnguardScript(t)); err != nil {
			return fmt.Errorf("detach %s from pod network: anti-spoofing rules for %s: %w", vmiKey, t, err)
		}
		if err := bridge.DetachTap(ctx, n.tapConf(), t); err != nil {
			return fmt.Errorf("detach %s from pod network: %w", vmiKey, err)
		}
	}
	gone, err := n.allocs.release(vmiKey, tap)
	if err != nil {
		return fmt.Errorf("detach %s from pod network: %w", vmiKey, err)
	}
	for _, e := range gone {
		n.log.Info("detached from pod network", "vmi", vmiKey, "tap", e.Tap, "mac", e.MAC, "ip", e.IP)
	}
	return nil
}

// Lease is the address allocated to mac, or nil when mac is not attached.
// It is what status.interfaces[].ipAddress reports.
func (n *Network) Lease(mac net.HardwareAddr) net.IP {
	n.mu.Lock()
	defer n.mu.Unlock()
	if e := n.allocs.get(mac); e != nil {
		return net.ParseIP(e.IP).To4()
	}
	return nil
}

// Attachment is one attached interface, as Attachments lists it.
type Attachment struct {
	VMI string
	Tap string
	MAC net.HardwareAddr
	IP  net.IP
}

// Attachments lists what is attached, ordered by address, so an agent can
// detach the interfaces of VMIs that are gone.
func (n *Network) Attachments() []Attachment {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []Attachment
	for _, e := range n.allocs.all() {
		mac, _ := net.ParseMAC(e.MAC)
		out = append(out, Attachment{VMI: e.VMI, Tap: e.Tap, MAC: mac, IP: net.ParseIP(e.IP).To4()})
	}
	return out
}

// lookup returns the address and VMI of an attached mac, for the DHCP
// server.
func (n *Network) lookup(mac net.HardwareAddr) (net.IP, string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if e := n.allocs.get(mac); e != nil {
		return net.ParseIP(e.IP).To4(), e.VMI
	}
	return nil, ""
}
