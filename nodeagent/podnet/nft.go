package podnet

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
)

// The network owns two nftables tables, both named nftTable:
//
//   - inet: outbound masquerade of the subnet and forward accept. It holds
//     nothing per guest, so Ensure replaces it atomically.
//   - bridge: anti-spoofing. Frames entering the bridge from a guest's tap
//     must carry the guest's MAC and, for IPv4 and ARP, its allocated
//     address (0.0.0.0 only for DHCP and ARP probes); other EtherTypes
//     (IPv6, VLAN tags) are dropped. A verdict map sends each tap to its own
//     chain, so Attach and Detach are single transactions, and Ensure only
//     adds what is missing, leaving running guests' chains in place.
//
// On one node bridge the guests share a segment; this is what keeps one
// guest from taking another's address, which KubeVirt gets from a pod per VM.

// nftInetScript replaces the inet table: creating it first makes the delete
// succeed on a fresh node, and the whole file is one transaction.
func (n *Network) nftInetScript() string {
	var b strings.Builder
	fmt.Fprintf(&b, "add table inet %s\n", nftTable)
	fmt.Fprintf(&b, "delete table inet %s\n", nftTable)
	fmt.Fprintf(&b, "table inet %s {\n", nftTable)
	fmt.Fprintf(&b, "\tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n")
	fmt.Fprintf(&b, "\t\tip saddr %s ip daddr != %s masquerade comment \"nodevirt pod network\"\n", n.subnet, n.subnet)
	fmt.Fprintf(&b, "\t}\n")
	fmt.Fprintf(&b, "\tchain forward {\n\t\ttype filter hook forward priority filter; policy accept;\n")
	fmt.Fprintf(&b, "\t\tiifname %q ip saddr %s accept\n", n.bridge, n.subnet)
	fmt.Fprintf(&b, "\t\toifname %q ip daddr %s ct state established,related accept\n", n.bridge, n.subnet)
	fmt.Fprintf(&b, "\t}\n}\n")
	return b.String()
}

// nftBridgeBase makes the bridge table, its map and base chain exist,
// without touching the per-tap chains.
func nftBridgeBase(b *strings.Builder) {
	fmt.Fprintf(b, "add table bridge %s\n", nftTable)
	fmt.Fprintf(b, "add map bridge %s taps { type ifname : verdict ; }\n", nftTable)
	fmt.Fprintf(b, "add chain bridge %s prerouting { type filter hook prerouting priority -300 ; policy accept ; }\n", nftTable)
	fmt.Fprintf(b, "flush chain bridge %s prerouting\n", nftTable)
	fmt.Fprintf(b, "add rule bridge %s prerouting iifname vmap @taps\n", nftTable)
}

func (n *Network) nftEnsureScript() string {
	var b strings.Builder
	b.WriteString(n.nftInetScript())
	nftBridgeBase(&b)
	return b.String()
}

// tapChain names a tap's chain after a hash of the tap (interface names
// may hold characters nft identifiers may not).
func tapChain(tap string) string {
	sum := sha256.Sum256([]byte(tap))
	return "tap_" + hex.EncodeToString(sum[:6])
}

// nftGuardScript pins tap to mac and ip.
func nftGuardScript(tap string, mac net.HardwareAddr, ip net.IP) string {
	var b strings.Builder
	nftBridgeBase(&b)
	c := tapChain(tap)
	fmt.Fprintf(&b, "add chain bridge %s %s\n", nftTable, c)
	fmt.Fprintf(&b, "flush chain bridge %s %s\n", nftTable, c)
	for _, r := range []string{
		fmt.Sprintf("ether saddr != %s counter drop", mac),
		"ether type != { ip, arp } counter drop",
		fmt.Sprintf("arp saddr ether != %s counter drop", mac),
		fmt.Sprintf("arp saddr ip != { %s, 0.0.0.0 } counter drop", ip),
		"ip saddr 0.0.0.0 udp sport 68 udp dport 67 accept",
		fmt.Sprintf("ip saddr != %s counter drop", ip),
	} {
		fmt.Fprintf(&b, "add rule bridge %s %s %s comment %q\n", nftTable, c, r, "tap "+tap)
	}
	fmt.Fprintf(&b, "add element bridge %s taps { %q : jump %s }\n", nftTable, tap, c)
	return b.String()
}

// nftUnguardScript removes a tap's chain; it succeeds whether or not it
// exists (each object is added before it is deleted, in one transaction).
func nftUnguardScript(tap string) string {
	var b strings.Builder
	nftBridgeBase(&b)
	c := tapChain(tap)
	fmt.Fprintf(&b, "add chain bridge %s %s\n", nftTable, c)
	fmt.Fprintf(&b, "add element bridge %s taps { %q : jump %s }\n", nftTable, tap, c)
	fmt.Fprintf(&b, "delete element bridge %s taps { %q }\n", nftTable, tap)
	fmt.Fprintf(&b, "flush chain bridge %s %s\n", nftTable, c)
	fmt.Fprintf(&b, "delete chain bridge %s %s\n", nftTable, c)
	return b.String()
}

// nftDeleteScript removes both tables, present or not.
func nftDeleteScript() string {
	return fmt.Sprintf("add table inet %[1]s\ndelete table inet %[1]s\nadd table bridge %[1]s\ndelete table bridge %[1]s\n", nftTable)
}

// runNFT applies script as one nft transaction.
func runNFT(ctx context.Context, script string) error {
	p, err := exec.LookPath("nft")
	if err != nil {
		p = "/usr/sbin/nft"
		if _, serr := os.Stat(p); serr != nil {
			return errors.New("nft binary not found (install nftables)")
		}
	}
	cmd := exec.CommandContext(ctx, p, "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}
