package handler

import (
	"context"
	"io"
	"net"
	"strconv"
	"strings"

	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"github.com/nodevirt/nodevirt/nodeagent/console"
)

var _ console.PortForwardBackend = (*Handler)(nil)

// PortForward connects to port of the VMI's guest at its pod network
// address (masquerade or bridge binding): the address this node's pod
// network leased to the interface, never one the guest reports, so a
// forward cannot be pointed at the node itself. A VMI without a pod network
// interface is refused; so is a port its masquerade interface does not
// list when it lists ports (KubeVirt forwards only those).
func (h *Handler) PortForward(ctx context.Context, namespace, name string, port int, protocol string) (io.ReadWriteCloser, error) {
	vmi, _, _, err := h.running(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	iface, ip, err := h.podAddress(vmi)
	if err != nil {
		return nil, err
	}
	if err := portAllowed(iface, port, protocol); err != nil {
		return nil, err
	}
	addr := net.JoinHostPort(ip.String(), strconv.Itoa(port))
	var d net.Dialer
	conn, err := d.DialContext(ctx, protocol, addr)
	if err != nil {
		return nil, httperr.BadGateway("dialing vmi %s/%s at %s %s: %v", namespace, name, protocol, addr, err)
	}
	h.log.Info("port forward", "vmi", namespace+"/"+name, "protocol", protocol, "addr", addr)
	return conn, nil
}

// podAddress is the VMI's first pod network interface and the address the
// pod network leased to it.
func (h *Handler) podAddress(vmi *v1.VirtualMachineInstance) (*v1.Interface, net.IP, error) {
	pod := ""
	for _, n := range vmi.Spec.Networks {
		if n.Pod != nil {
			pod = n.Name
			break
		}
	}
	var iface *v1.Interface
	for i := range vmi.Spec.Domain.Devices.Interfaces {
		if vmi.Spec.Domain.Devices.Interfaces[i].Name == pod {
			iface = &vmi.Spec.Domain.Devices.Interfaces[i]
		}
	}
	if pod == "" || iface == nil || h.cfg.PodNetwork == nil {
		return nil, nil, httperr.BadRequest("vmi %s/%s has no interface on the pod network: port forwarding reaches a guest at its pod network address (masquerade or bridge binding)", vmi.Namespace, vmi.Name)
	}
	r, err := h.readRecord(vmi.UID)
	if err != nil {
		return nil, nil, err
	}
	if r != nil {
		for _, t := range r.Taps {
			if !t.Pod || t.Interface != iface.Name {
				continue
			}
			if mac, err := net.ParseMAC(t.MAC); err == nil {
				if ip := h.cfg.PodNetwork.Lease(mac); ip != nil {
					return iface, ip, nil
				}
			}
		}
	}
	return nil, nil, httperr.Conflict("vmi %s/%s: interface %s has no pod network address yet", vmi.Namespace, vmi.Name, iface.Name)
}

// portAllowed refuses a port a masquerade interface that lists its ports
// does not list.
func portAllowed(iface *v1.Interface, port int, protocol string) error {
	if iface.Masquerade == nil || len(iface.Ports) == 0 {
		return nil
	}
	for _, p := range iface.Ports {
		proto := strings.ToLower(p.Protocol)
		if proto == "" {
			proto = console.ProtocolTCP
		}
		if int(p.Port) == port && proto == protocol {
			return nil
		}
	}
	return httperr.Forbidden("port %d/%s is not among the ports of interface %s", port, protocol, iface.Name)
}
