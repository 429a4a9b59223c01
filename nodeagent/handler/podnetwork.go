package handler

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/vishvananda/netlink"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/cni/bridge"
	"github.com/nodevirt/nodevirt/nodeagent/podnet"
)

// PodNetwork is the node's NAT network for interfaces on the pod network
// (`networks: [{pod: {}}]` with the masquerade or bridge binding);
// podnet.Network satisfies it. Without one (Config.PodNetwork nil) such VMIs
// fail with a condition saying the node has no pod network; with one whose
// setup failed (Config.PodNetworkErr) they wait, Synchronized=False with
// that error.
type PodNetwork interface {
	// Attach makes (or re-adopts) tap on the network for mac and returns
	// what the tap attach made (for the domain's NIC) and the address the
	// network's DHCP server hands that MAC.
	Attach(ctx context.Context, vmiKey, tap string, mac net.HardwareAddr, ownerUID int) (*bridge.Attachment, net.IP, error)
	// Detach removes tap and releases its address; gone is success.
	Detach(ctx context.Context, vmiKey, tap string) error
	// Lease is mac's address, nil when mac is not attached.
	Lease(mac net.HardwareAddr) net.IP
	// Attachments lists what is attached, to detach what no VMI owns.
	Attachments() []podnet.Attachment
}

var _ PodNetwork = (*podnet.Network)(nil)

// errPodNetwork refuses pod network interfaces on a node without a pod
// network.
var errPodNetwork = errors.New("the pod network (masquerade or bridge binding on spec.networks[].pod) is not enabled on this node: use a Multus network with the bridge binding, or run the nodeagent with a pod network")

// podKey names a VMI to the pod network: namespace/name/uid, so that a
// VMI recreated under the same name never shares the old one's entry.
func podKey(namespace, name string, uid types.UID) string {
	return namespace + "/" + name + "/" + string(uid)
}

// interfaceMAC is the MAC of an interface: the one in the spec (the brain's
// MAC pool fills it in for VMs), else one derived from the VMI UID and
// interface name, locally administered and unicast, so an agent restart
// derives the same (bare VMIs have no MAC from the pool).
func interfaceMAC(vmi *v1.VirtualMachineInstance, iface *v1.Interface) (net.HardwareAddr, error) {
	if iface.MacAddress != "" {
		mac, err := net.ParseMAC(iface.MacAddress)
		if err != nil || len(mac) != 6 {
			return nil, fmt.Errorf("%w: interface %s: %q is not a MAC-48 address", errSpec, iface.Name, iface.MacAddress)
		}
		return mac, nil
	}
	sum := sha256.Sum256([]byte("pod/" + string(vmi.UID) + "/" + iface.Name))
	mac := net.HardwareAddr(sum[:6])
	mac[0] = (mac[0] | 0x02) &^ 0x01
	return mac, nil
}

// podTap plans the tap of a pod network interface, or says why the node
// cannot give it one.
func (h *Handler) podTap(vmi *v1.VirtualMachineInstance, iface *v1.Interface, path string) (tapRecord, error) {
	if iface.Masquerade == nil && iface.Bridge == nil {
		return tapRecord{}, fmt.Errorf("%w: %s (%s): only the masquerade and bridge bindings can connect to the pod network", errSpec, path, iface.Name)
	}
	if h.cfg.PodNetwork == nil {
		return tapRecord{}, fmt.Errorf("%s (%s): %w", path, iface.Name, errPodNetwork)
	}
	if err := h.cfg.PodNetworkErr; err != nil {
		return tapRecord{}, fmt.Errorf("%w: %s (%s): the pod network of node %s is not available (%w); it is set up when the nodeagent starts",
			errWaiting, path, iface.Name, h.cfg.NodeName, err)
	}
	mac, err := interfaceMAC(vmi, iface)
	if err != nil {
		return tapRecord{}, err
	}
	return tapRecord{Interface: iface.Name, Tap: tapName(vmi.UID, iface.Name), Pod: true, MAC: mac.String()}, nil
}

// attachPodTap attaches one planned pod network tap and returns what the
// attach made.
func (h *Handler) attachPodTap(ctx context.Context, key string, t tapRecord) (*bridge.Attachment, error) {
	if h.cfg.PodNetwork == nil {
		return nil, fmt.Errorf("interface %s: %w", t.Interface, errPodNetwork)
	}
	if err := h.cfg.PodNetworkErr; err != nil {
		return nil, fmt.Errorf("%w: interface %s: the pod network is not available: %w", errWaiting, t.Interface, err)
	}
	mac, err := net.ParseMAC(t.MAC)
	if err != nil {
		return nil, fmt.Errorf("interface %s: recorded mac %q: %w", t.Interface, t.MAC, err)
	}
	a, _, err := h.cfg.PodNetwork.Attach(ctx, key, t.Tap, mac, -1)
	if err != nil {
		return nil, fmt.Errorf("interface %s: %w", t.Interface, err)
	}
	return a, nil
}

// detachPodTap removes a pod network tap. Without a pod network (the agent
// now runs without one) the tap link alone is removed; its address entry
// stays with the network's state.
func (h *Handler) detachPodTap(ctx context.Context, r *record, t tapRecord) error {
	if h.cfg.PodNetwork != nil {
		return h.cfg.PodNetwork.Detach(ctx, podKey(r.Namespace, r.Name, r.UID), t.Tap)
	}
	l, err := netlink.LinkByName(t.Tap)
	if err != nil {
		return nil
	}
	if err := netlink.LinkDel(l); err != nil {
		return fmt.Errorf("delete tap %s: %w", t.Tap, err)
	}
	return nil
}

// readoptPodTaps attaches a running VMI's pod network taps again after an
// agent restart (once per VMI and run): the network re-applies its
// per-tap rules and keeps the address. Nothing happens without a pod
// network or for VMIs without pod taps.
func (h *Handler) readoptPodTaps(ctx context.Context, vmi *v1.VirtualMachineInstance) error {
	if h.cfg.PodNetwork == nil || h.cfg.PodNetworkErr != nil {
		return nil
	}
	h.mu.Lock()
	done := h.adopted[vmi.UID]
	h.mu.Unlock()
	if done {
		return nil
	}
	r, err := h.readRecord(vmi.UID)
	if err != nil || r == nil {
		return err
	}
	key := podKey(r.Namespace, r.Name, r.UID)
	for _, t := range r.Taps {
		if !t.Pod {
			continue
		}
		if _, err := h.attachPodTap(ctx, key, t); err != nil {
			return fmt.Errorf("re-adopt pod network interface of %s/%s: %w", vmi.Namespace, vmi.Name, err)
		}
		h.log.Info("re-adopted pod network interface", "vmi", vmi.Namespace+"/"+vmi.Name, "interface", t.Interface, "tap", t.Tap)
	}
	h.markAdopted(vmi.UID, true)
	return nil
}

func (h *Handler) markAdopted(uid types.UID, on bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if on {
		h.adopted[uid] = true
	} else {
		delete(h.adopted, uid)
	}
}

// sweepPodNetwork detaches pod network entries of VMIs this handler has no
// state for (removed while the agent was down, after their state went).
// Entries whose key is not namespace/name/uid are someone else's.
func (h *Handler) sweepPodNetwork(ctx context.Context) error {
	if h.cfg.PodNetwork == nil {
		return nil
	}
	var errs []error
	for _, a := range h.cfg.PodNetwork.Attachments() {
		parts := strings.Split(a.VMI, "/")
		if len(parts) != 3 || h.owns(types.UID(parts[2])) {
			continue
		}
		h.log.Info("detaching pod network interface of a vmi without state", "vmi", parts[0]+"/"+parts[1], "tap", a.Tap, "ip", a.IP)
		errs = append(errs, h.cfg.PodNetwork.Detach(ctx, a.VMI, a.Tap))
	}
	return errors.Join(errs...)
}

// podLeases maps each pod network interface of vmi to the address leased
// to its MAC (from the domain when the spec has none).
func (h *Handler) podLeases(vmi *v1.VirtualMachineInstance, macs map[string]string) map[string]net.IP {
	if h.cfg.PodNetwork == nil {
		return nil
	}
	pod := map[string]bool{}
	for _, n := range vmi.Spec.Networks {
		pod[n.Name] = n.Pod != nil
	}
	out := map[string]net.IP{}
	for _, iface := range vmi.Spec.Domain.Devices.Interfaces {
		if !pod[iface.Name] {
			continue
		}
		mac, err := net.ParseMAC(macs[iface.Name])
		if err != nil {
			continue
		}
		if ip := h.cfg.PodNetwork.Lease(mac); ip != nil {
			out[iface.Name] = ip
		}
	}
	return out
}
