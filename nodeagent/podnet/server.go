package podnet

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	dhcpServerPort = 67
	dhcpClientPort = 68
	// rebindCheck is how often Run checks that the bridge it listens on is
	// still the same link (a bridge deleted and made again has a new index
	// and the old socket would hear nothing).
	rebindCheck = 5 * time.Second
)

// Run serves DHCPv4 on the bridge until ctx ends, answering only MACs that
// are attached. Ensure must have run: Run fails when the bridge is missing
// at start. Later socket errors (the bridge recreated) are retried.
func (n *Network) Run(ctx context.Context) error {
	conn, index, err := n.listen(ctx)
	if err != nil {
		return err
	}
	n.log.Info("dhcp server listening", "gateway", n.gateway)
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	buf := make([]byte, 1500)
	for {
		_ = conn.SetReadDeadline(time.Now().Add(rebindCheck))
		nr, from, err := conn.ReadFromUDP(buf)
		if ctx.Err() != nil {
			stop()
			conn.Close()
			return nil
		}
		if err == nil {
			n.serve(conn, buf[:nr], from)
			continue
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			if l, lerr := net.InterfaceByName(n.bridge); lerr == nil && l.Index == index {
				continue
			}
		} else {
			n.log.Warn("dhcp read failed, reopening", "error", err)
		}
		stop()
		conn.Close()
		for {
			if conn, index, err = n.listen(ctx); err == nil {
				break
			}
			n.log.Warn("dhcp server cannot listen, retrying", "error", err)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(time.Second):
			}
		}
		n.log.Info("dhcp server listening again", "index", index)
		stop = context.AfterFunc(ctx, func() { conn.Close() })
	}
}

// listen opens UDP port 67 bound to the bridge (SO_BINDTODEVICE), so it
// hears only this bridge's clients and its broadcasts leave through it;
// SO_REUSEADDR lets another DHCP server bound to another device share the
// port.
func (n *Network) listen(ctx context.Context) (*net.UDPConn, int, error) {
	ifc, err := net.InterfaceByName(n.bridge)
	if err != nil {
		return nil, 0, fmt.Errorf("dhcp server on %s: %w (Ensure not run?)", n.bridge, err)
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); serr != nil {
				return
			}
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_BROADCAST, 1); serr != nil {
				return
			}
			serr = unix.BindToDevice(int(fd), n.bridge)
		})
		if err != nil {
			return err
		}
		return serr
	}}
	pc, err := lc.ListenPacket(ctx, "udp4", fmt.Sprintf("0.0.0.0:%d", dhcpServerPort))
	if err != nil {
		return nil, 0, fmt.Errorf("dhcp server on %s: %w", n.bridge, err)
	}
	return pc.(*net.UDPConn), ifc.Index, nil
}

// serve answers one datagram.
func (n *Network) serve(conn *net.UDPConn, b []byte, from *net.UDPAddr) {
	req, err := parseDHCP(b)
	if err != nil {
		n.log.Debug("ignoring dhcp datagram", "from", from, "error", err)
		return
	}
	mtu := n.mtu
	if ifc, err := net.InterfaceByName(n.bridge); err == nil {
		mtu = ifc.MTU
	}
	resp, dst := n.reply(req, mtu)
	if resp == nil {
		return
	}
	to := &net.UDPAddr{IP: dst, Port: dhcpClientPort}
	if _, err := conn.WriteToUDP(resp.marshal(), to); err != nil {
		n.log.Warn("dhcp reply failed", "mac", req.CHAddr.String(), "to", to, "error", err)
	}
}

// reply decides the answer to req and where it goes; nil when req gets no
// answer (unknown MAC, another server chosen, nothing to say).
func (n *Network) reply(req *dhcpMsg, mtu int) (*dhcpMsg, net.IP) {
	if req.Op != bootRequest {
		return nil, nil
	}
	ip, vmi := n.lookup(req.CHAddr)
	log := n.log.With("vmi", vmi, "mac", req.CHAddr.String(), "xid", fmt.Sprintf("%#08x", req.XID))
	if ip == nil {
		n.log.Debug("ignoring dhcp request of a MAC not attached", "mac", req.CHAddr.String())
		return nil, nil
	}
	t := req.msgType()
	switch t {
	case dhcpDiscover:
		log.Debug("dhcp discover", "offer", ip)
		return n.answer(req, dhcpOffer, ip, vmi, mtu), net.IPv4bcast
	case dhcpRequest:
		if sid := req.optionIP(optServerID); sid != nil && !sid.Equal(n.gateway) {
			log.Debug("client chose another dhcp server", "server", sid)
			return nil, nil
		}
		want := req.optionIP(optRequestedIP)
		if want == nil && !req.CIAddr.IsUnspecified() {
			want = req.CIAddr
		}
		if !ip.Equal(want) {
			log.Info("dhcp nak", "requested", want, "allocated", ip)
			nak := &dhcpMsg{
				Op: bootReply, XID: req.XID, Flags: req.Flags, GIAddr: req.GIAddr, CHAddr: req.CHAddr,
				Options: []dhcpOption{{optMessageType, []byte{dhcpNak}}, {optServerID, n.gateway.To4()}},
			}
			return nak, net.IPv4bcast
		}
		log.Info("dhcp ack", "ip", ip)
		return n.answer(req, dhcpAck, ip, vmi, mtu), n.destination(req)
	case dhcpInform:
		resp := n.answer(req, dhcpAck, nil, vmi, mtu)
		return resp, n.destination(req)
	case dhcpDecline:
		log.Warn("guest declined its address: something else on the bridge uses it", "ip", ip)
	case dhcpRelease:
		log.Info("guest released its address (kept for the VMI)", "ip", ip)
	default:
		log.Debug("ignoring dhcp message", "type", t)
	}
	return nil, nil
}

// destination is where an ACK goes: the client's own address when it has
// one (renewing), else broadcast (the client cannot answer ARP yet).
func (n *Network) destination(req *dhcpMsg) net.IP {
	if !req.CIAddr.IsUnspecified() && n.subnet.Contains(req.CIAddr) {
		return req.CIAddr
	}
	return net.IPv4bcast
}

// answer builds an OFFER or ACK giving yiaddr (nil for an INFORM's ACK,
// which carries configuration but no address or lease).
func (n *Network) answer(req *dhcpMsg, typ byte, yiaddr net.IP, vmi string, mtu int) *dhcpMsg {
	u32 := func(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
	lease := uint32(n.leaseTime / time.Second)
	bcast := make(net.IP, 4)
	for i := range bcast {
		bcast[i] = n.subnet.IP[i] | ^n.subnet.Mask[i]
	}
	m := &dhcpMsg{Op: bootReply, XID: req.XID, Flags: req.Flags, GIAddr: req.GIAddr, CHAddr: req.CHAddr}
	if typ == dhcpAck {
		m.CIAddr = req.CIAddr
	}
	opts := []dhcpOption{{optMessageType, []byte{typ}}, {optServerID, n.gateway.To4()}}
	if yiaddr != nil {
		m.YIAddr = yiaddr
		opts = append(opts,
			dhcpOption{optLeaseTime, u32(lease)},
			dhcpOption{optRenewalT1, u32(lease / 2)},
			dhcpOption{optRebindingT2, u32(lease / 8 * 7)})
	}
	opts = append(opts,
		dhcpOption{optSubnetMask, []byte(n.subnet.Mask)},
		dhcpOption{optBroadcast, bcast},
		dhcpOption{optRouter, n.gateway.To4()})
	var dns []byte
	for _, d := range n.dns {
		dns = append(dns, d.To4()...)
	}
	opts = append(opts, dhcpOption{optDNS, dns})
	if mtu >= 68 && mtu <= 65535 {
		opts = append(opts, dhcpOption{optMTU, binary.BigEndian.AppendUint16(nil, uint16(mtu))})
	}
	if h := hostnameOf(vmi); h != "" {
		opts = append(opts, dhcpOption{optHostname, []byte(h)})
	}
	if len(n.search) > 0 {
		opts = append(opts, dhcpOption{optDomainName, []byte(n.search[0])})
		if s := encodeDomainSearch(n.search); len(s) > 0 {
			opts = append(opts, dhcpOption{optDomainSearch, s})
		}
	}
	m.Options = opts
	return m
}
