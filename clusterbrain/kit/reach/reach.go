// Package reach is the network reach policy of everything that fetches a
// URL a user named (a DataVolume's HTTP or registry source, a
// containerDisk, a DataImportCron's registry): which addresses such a
// fetch may connect to, and an HTTP client that enforces it. Both daemons
// use it: the node agent's importer and containerDisk puller, and the
// brain's DataImportCron controller polling a registry digest.
//
// By default a fetch may not connect to:
//
//   - loopback (127.0.0.0/8, ::1) and unspecified addresses,
//   - link-local addresses (169.254.0.0/16, fe80::/10), where the cloud
//     metadata services live, and the other well-known metadata endpoints
//     (fd00:ec2::254, 100.100.100.200, 168.63.129.16),
//   - multicast addresses,
//   - any address of this host's own interfaces,
//
// so that a user-given URL cannot make the host read its own services or
// its cloud credentials. The check is made on the address actually dialed
// (after DNS resolution, so rebinding a name does not get around it), on
// every connection, including those of redirects and of registry token
// requests. Addresses inside an allowed prefix are reached anyway (the CDI
// CR's nodevirt.io/import-allowed-networks annotation, see
// importstate.AnnImportAllowedNetworks, read with ParseNetworks). When a
// proxy is configured the dial goes to the proxy (which the administrator
// chose); the target's resolved addresses are checked before the request
// is sent through it.
//
// A refused connection fails with a *NotAllowedError somewhere in the
// error's chain (find it with errors.As).
package reach

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"time"
)

// wellKnownMetadata are metadata endpoints outside link-local ranges.
var wellKnownMetadata = []netip.Prefix{
	netip.MustParsePrefix("fd00:ec2::254/128"),  // AWS (IPv6)
	netip.MustParsePrefix("100.100.100.200/32"), // Alibaba Cloud
	netip.MustParsePrefix("168.63.129.16/32"),   // Azure wire server
}

// ParseNetworks reads a comma- or space-separated list of CIDR prefixes
// and single addresses (the allowed-networks annotation).
func ParseNetworks(s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '\t' }) {
		if p, err := netip.ParsePrefix(f); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(f)
		if err != nil {
			return nil, fmt.Errorf("allowed network %q: want a CIDR prefix or an address", f)
		}
		out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
	}
	return out, nil
}

// NotAllowedError is why a connection was refused by the policy.
type NotAllowedError struct {
	// Addr is the refused address.
	Addr netip.Addr
	// Why names the forbidden kind of address ("a loopback address").
	Why string
}

func (e *NotAllowedError) Error() string {
	return fmt.Sprintf("import may not connect to %s: %s (allow it with the CDI annotation nodevirt.io/import-allowed-networks)", e.Addr, e.Why)
}

// IsNotAllowed reports whether err's chain holds a *NotAllowedError.
func IsNotAllowed(err error) bool {
	var na *NotAllowedError
	return errors.As(err, &na)
}

// policy decides which addresses a fetch may connect to.
type policy struct {
	allowed []netip.Prefix
	// ownAddrs lists this host's addresses; nil means the interfaces'.
	ownAddrs func() []netip.Addr
}

// check returns why ip may not be reached, or nil.
func (p *policy) check(ip netip.Addr) error {
	ip = ip.Unmap()
	for _, a := range p.allowed {
		if a.Contains(ip) {
			return nil
		}
	}
	why := ""
	switch {
	case ip.IsLoopback():
		why = "a loopback address"
	case ip.IsUnspecified():
		why = "an unspecified address"
	case ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast():
		why = "a link-local (cloud metadata) address"
	case ip.IsMulticast():
		why = "a multicast address"
	}
	for _, m := range wellKnownMetadata {
		if why == "" && m.Contains(ip) {
			why = "a cloud metadata address"
		}
	}
	if why == "" {
		for _, own := range p.own() {
			if own == ip {
				why = "an address of this node"
				break
			}
		}
	}
	if why == "" {
		return nil
	}
	return &NotAllowedError{Addr: ip, Why: why}
}

func (p *policy) own() []netip.Addr {
	if p.ownAddrs != nil {
		return p.ownAddrs()
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out
}

// control is a net.Dialer Control: it runs on the resolved address just
// before connect.
func (p *policy) control(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("dial %s: %w", address, err)
	}
	return p.check(ap.Addr())
}

// checkHost resolves host (a name or an address literal) and checks every
// address; used where the dial does not reach the host itself (proxies)
// and to fail early on redirects.
func (p *policy) checkHost(ctx context.Context, host string) error {
	if ip, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		return p.check(ip)
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return nil // the dial reports it
	}
	for _, ip := range ips {
		if err := p.check(ip); err != nil {
			return err
		}
	}
	return nil
}

// dialer returns the DialContext of a fetch's transport: dials to the
// proxies (trusted, configured by the administrator) go out as they are,
// every other dial is checked on its resolved address.
func (p *policy) dialer(proxy *Proxy) func(ctx context.Context, network, addr string) (net.Conn, error) {
	plain := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	checked := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, Control: p.control}
	trusted := map[string]bool{}
	if proxy != nil {
		for _, raw := range []string{proxy.HTTPProxy, proxy.HTTPSProxy} {
			if raw == "" {
				continue
			}
			if !strings.Contains(raw, "://") {
				raw = "http://" + raw
			}
			if u, err := url.Parse(raw); err == nil {
				port := u.Port()
				if port == "" {
					port = map[string]string{"https": "443"}[u.Scheme]
					if port == "" {
						port = "80"
					}
				}
				trusted[net.JoinHostPort(u.Hostname(), port)] = true
			}
		}
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if trusted[addr] {
			return plain.DialContext(ctx, network, addr)
		}
		return checked.DialContext(ctx, network, addr)
	}
}

// maxRedirects is how many redirects a fetch follows.
const maxRedirects = 10

// checkRedirect re-checks the target of every redirect.
func (p *policy) checkRedirect(req *http.Request, via []*http.Request) error {
	if len(via) >= maxRedirects {
		return fmt.Errorf("stopped after %d redirects", maxRedirects)
	}
	if req.URL.Scheme != "http" && req.URL.Scheme != "https" {
		return fmt.Errorf("redirect to scheme %q", req.URL.Scheme)
	}
	return p.checkHost(req.Context(), req.URL.Hostname())
}
