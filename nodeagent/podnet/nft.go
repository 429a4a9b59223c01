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

// The network owns two nftables tables, both named TableName(bridge), so
// pod networks on different bridges of one host keep apart:
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
	fmt.Fprintf(&b, "add table inet %s\n", n.table)
	fmt.Fprintf(&b, "delete table inet %s\n", n.table)
	fmt.Fprintf(&b, "table inet %s {\n", n.table)
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
func (n *Network) nftBridgeBase(b *strings.Builder) {
	fmt.Fprintf(b, "add table bridge %s\n", n.table)
	fmt.Fprintf(b, "add map bridge %s taps { type ifname : verdict ; }\n", n.table)
	fmt.Fprintf(b, "add chain bridge %s prerouting { type filter hook prerouting priority -300 ; policy accept ; }\n", n.table)
	fmt.Fprintf(b, "flush chain bridge %s prerouting\n", n.table)
	fmt.Fprintf(b, "add rule bridge %s prerouting iifname vmap @taps\n", n.table)
}

func (n *Network) nftEnsureScript() string {
	var b strings.Builder
	b.WriteString(n.nftInetScript())
	n.nftBridgeBase(&b)
	return b.String()
}

// tapChain names a tap's chain after a hash of the tap (interface names
// may hold characters nft identifiers may not).
func tapChain(tap string) string {
	sum := sha256.Sum256([]byte(tap))
	return "tap_" + hex.EncodeToString(sum[:6])
}

// nftGuardScript pins tap to mac and ip.
func (n *Network) nftGuardScript(tap string, mac net.HardwareAddr, ip net.IP) string {
	var b strings.Builder
	n.nftBridgeBase(&b)
	c := tapChain(tap)
	fmt.Fprintf(&b, "add chain bridge %s %s\n", n.table, c)
	fmt.Fprintf(&b, "flush chain bridge %s %s\n", n.table, c)
	for _, r := range []string{
		fmt.Sprintf("ether saddr != %s counter drop", mac),
		"ether type != { ip, arp } counter drop",
		fmt.Sprintf("arp saddr ether != %s counter drop", mac),
		fmt.Sprintf("arp saddr ip != { %s, 0.0.0.0 } counter drop", ip),
		"ip saddr 0.0.0.0 udp sport 68 udp dport 67 accept",
		fmt.Sprintf("ip saddr != %s counter drop", ip),
	} {
		fmt.Fprintf(&b, "add rule bridge %s %s %s comment %q\n", n.table, c, r, "tap "+tap)
	}
	fmt.Fprintf(&b, "add element bridge %s taps { %q : jump %s }\n", n.table, tap, c)
	return b.String()
}

// nftUnguardScript removes a tap's chain; it succeeds whether or not it
// exists (each object is added before it is deleted, in one transaction).
func (n *Network) nftUnguardScript(tap string) string {
	var b strings.Builder
	n.nftBridgeBase(&b)
	c := tapChain(tap)
	fmt.Fprintf(&b, "add chain bridge %s %s\n", n.table, c)
	fmt.Fprintf(&b, "add element bridge %s taps { %q : jump %s }\n", n.table, tap, c)
	fmt.Fprintf(&b, "delete element bridge %s taps { %q }\n", n.table, tap)
	fmt.Fprintf(&b, "flush chain bridge %s %s\n", n.table, c)
	fmt.Fprintf(&b, "delete chain bridge %s %s\n", n.table, c)
	return b.String()
}

// nftDeleteScript removes both tables, present or not.
func (n *Network) nftDeleteScript() string {
	return fmt.Sprintf("add table inet %[1]s\ndelete table inet %[1]s\nadd table bridge %[1]s\ndelete table bridge %[1]s\n", n.table)
}

// TableName is the nftables table (in the inet and bridge families) of
// the pod network on bridge: the bridge's name when nft takes it as an
// identifier, else a hash of it.
func TableName(bridge string) string {
	for _, r := range bridge {
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
			sum := sha256.Sum256([]byte(bridge))
			return tablePrefix + "h" + hex.EncodeToString(sum[:4])
		}
	}
	return tablePrefix + bridge
}

// otherTables lists the inet tables of pod networks other than n's in
// this network namespace.
func (n *Network) otherTables(ctx context.Context) ([]string, error) {
	out, err := exec.CommandContext(ctx, nftPath(), "list", "tables", "inet").Output()
	if err != nil {
		return nil, fmt.Errorf("nft list tables: %w", err)
	}
	var others []string
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) == 3 && strings.HasPrefix(f[2], tablePrefix) && f[2] != n.table {
			others = append(others, f[2])
		}
	}
	return others, nil
}

// nftPath is where the nft binary is: on PATH, else Debian's place.
func nftPath() string {
	if p, err := exec.LookPath("nft"); err == nil {
		return p
	}
	return "/usr/sbin/nft"
}

// runNFT applies script as one nft transaction.
func runNFT(ctx context.Context, script string) error {
	p := nftPath()
	if _, err := os.Stat(p); err != nil {
		return errors.New("nft binary not found (install nftables)")
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
