package podnet

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
)

// DHCP message types (option 53), RFC 2132 §9.6.
const (
	dhcpDiscover = 1
	dhcpOffer    = 2
	dhcpRequest  = 3
	dhcpDecline  = 4
	dhcpAck      = 5
	dhcpNak      = 6
	dhcpRelease  = 7
	dhcpInform   = 8
)

// DHCP option codes used here, RFC 2132 and RFC 3397.
const (
	optPad          = 0
	optSubnetMask   = 1
	optRouter       = 3
	optDNS          = 6
	optHostname     = 12
	optDomainName   = 15
	optMTU          = 26
	optBroadcast    = 28
	optRequestedIP  = 50
	optLeaseTime    = 51
	optMessageType  = 53
	optServerID     = 54
	optRenewalT1    = 58
	optRebindingT2  = 59
	optDomainSearch = 119
	optEnd          = 255
)

const (
	bootRequest = 1
	bootReply   = 2
	// dhcpHeaderLen is the fixed BOOTP part before the magic cookie.
	dhcpHeaderLen = 236
	// bootpMinLen is the smallest message some clients accept.
	bootpMinLen = 300
	// flagBroadcast is the BOOTP broadcast flag.
	flagBroadcast = 0x8000
)

var magicCookie = []byte{99, 130, 83, 99}

// dhcpMsg is a decoded BOOTP/DHCP message. Only Ethernet clients are served.
type dhcpMsg struct {
	Op     byte
	XID    uint32
	Flags  uint16
	CIAddr net.IP
	YIAddr net.IP
	SIAddr net.IP
	GIAddr net.IP
	CHAddr net.HardwareAddr
	// Options in wire order; a code that appears more than once has its
	// parts concatenated (RFC 3396).
	Options []dhcpOption
}

type dhcpOption struct {
	Code byte
	Data []byte
}

// option returns the data of code, or nil.
func (m *dhcpMsg) option(code byte) []byte {
	for _, o := range m.Options {
		if o.Code == code {
			return o.Data
		}
	}
	return nil
}

// msgType is option 53, or 0 for a plain BOOTP message.
func (m *dhcpMsg) msgType() byte {
	if d := m.option(optMessageType); len(d) == 1 {
		return d[0]
	}
	return 0
}

// optionIP is a 4-byte address option, or nil.
func (m *dhcpMsg) optionIP(code byte) net.IP {
	if d := m.option(code); len(d) == 4 {
		return net.IPv4(d[0], d[1], d[2], d[3]).To4()
	}
	return nil
}

// parseDHCP decodes a BOOTP/DHCP message of an Ethernet client.
func parseDHCP(b []byte) (*dhcpMsg, error) {
	if len(b) < dhcpHeaderLen+len(magicCookie) {
		return nil, fmt.Errorf("dhcp message of %d bytes is too short", len(b))
	}
	if b[1] != 1 || b[2] != 6 {
		return nil, fmt.Errorf("dhcp hardware type %d length %d: only Ethernet is served", b[1], b[2])
	}
	if string(b[dhcpHeaderLen:dhcpHeaderLen+4]) != string(magicCookie) {
		return nil, errors.New("dhcp magic cookie missing")
	}
	ip := func(off int) net.IP { return net.IPv4(b[off], b[off+1], b[off+2], b[off+3]).To4() }
	m := &dhcpMsg{
		Op:     b[0],
		XID:    binary.BigEndian.Uint32(b[4:8]),
		Flags:  binary.BigEndian.Uint16(b[10:12]),
		CIAddr: ip(12),
		YIAddr: ip(16),
		SIAddr: ip(20),
		GIAddr: ip(24),
		CHAddr: net.HardwareAddr(append([]byte(nil), b[28:34]...)),
	}
	opts := b[dhcpHeaderLen+4:]
	seen := map[byte]int{}
	for i := 0; i < len(opts); {
		code := opts[i]
		if code == optPad {
			i++
			continue
		}
		if code == optEnd {
			break
		}
		if i+1 >= len(opts) || i+2+int(opts[i+1]) > len(opts) {
			return nil, fmt.Errorf("dhcp option %d runs past the message", code)
		}
		data := opts[i+2 : i+2+int(opts[i+1])]
		if j, ok := seen[code]; ok {
			m.Options[j].Data = append(m.Options[j].Data, data...)
		} else {
			seen[code] = len(m.Options)
			m.Options = append(m.Options, dhcpOption{Code: code, Data: append([]byte(nil), data...)})
		}
		i += 2 + len(data)
	}
	return m, nil
}

// marshal encodes m, splitting options longer than 255 bytes (RFC 3396)
// and padding to the BOOTP minimum size.
func (m *dhcpMsg) marshal() []byte {
	b := make([]byte, dhcpHeaderLen, bootpMinLen)
	b[0], b[1], b[2] = m.Op, 1, 6
	binary.BigEndian.PutUint32(b[4:8], m.XID)
	binary.BigEndian.PutUint16(b[10:12], m.Flags)
	for off, ip := range map[int]net.IP{12: m.CIAddr, 16: m.YIAddr, 20: m.SIAddr, 24: m.GIAddr} {
		if ip4 := ip.To4(); ip4 != nil {
			copy(b[off:off+4], ip4)
		}
	}
	copy(b[28:44], m.CHAddr)
	b = append(b, magicCookie...)
	for _, o := range m.Options {
		data := o.Data
		for {
			part := data[:min(len(data), 255)]
			b = append(b, o.Code, byte(len(part)))
			b = append(b, part...)
			data = data[len(part):]
			if len(data) == 0 {
				break
			}
		}
	}
	b = append(b, optEnd)
	for len(b) < bootpMinLen {
		b = append(b, optPad)
	}
	return b
}

// encodeDomainSearch encodes domains as option 119 wants them (RFC 3397):
// uncompressed DNS names one after another. Invalid names are skipped.
func encodeDomainSearch(domains []string) []byte {
	var out []byte
	for _, d := range domains {
		d = strings.TrimSuffix(d, ".")
		if d == "" || len(d) > 253 {
			continue
		}
		var name []byte
		ok := true
		for _, label := range strings.Split(d, ".") {
			if label == "" || len(label) > 63 {
				ok = false
				break
			}
			name = append(name, byte(len(label)))
			name = append(name, label...)
		}
		if ok {
			out = append(out, append(name, 0)...)
		}
	}
	return out
}

// hostnameOf derives the guest hostname from a VMI key "namespace/name[/…]"
// (or a bare name); "" when the name is no valid hostname label.
func hostnameOf(vmiKey string) string {
	parts := strings.Split(vmiKey, "/")
	name := parts[0]
	if len(parts) > 1 {
		name = parts[1]
	}
	if name == "" || len(name) > 63 || name[0] == '-' || name[len(name)-1] == '-' {
		return ""
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
			return ""
		}
	}
	return name
}
