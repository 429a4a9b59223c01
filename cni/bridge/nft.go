package bridge

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strings"
)

// The rules live in two tables of their own. Every attachment gets one chain
// named after a hash of its port (spoof) or attachment (masquerade); a
// verdict map in the base chain jumps to it. Adding and removing an
// attachment is therefore one atomic nft transaction without rule handles,
// and removal works from the recorded names alone, without the netns.
const (
	spoofTable = "nodevirt_bridge"
	natTable   = "nodevirt_bridge_nat"
)

// nftPath finds the nft binary.
func nftPath() (string, error) {
	if p, err := exec.LookPath("nft"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/nft", "/sbin/nft"} {
		if _, err := exec.LookPath(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("nft binary not found (install nftables)")
}

// runNFT applies script as one nft transaction.
func runNFT(ctx context.Context, script string) error {
	p, err := nftPath()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, p, "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// listNFTChain prints one chain, or "" when it does not exist.
func listNFTChain(ctx context.Context, family, table, chain string) (string, error) {
	p, err := nftPath()
	if err != nil {
		return "", err
	}
	var out, errOut bytes.Buffer
	cmd := exec.CommandContext(ctx, p, "list", "chain", family, table, chain)
	cmd.Stdout = &out
	cmd.Stderr = &errOut
	if err := cmd.Run(); err != nil {
		if strings.Contains(errOut.String(), "No such file or directory") {
			return "", nil
		}
		return "", fmt.Errorf("nft list chain %s %s %s: %w: %s", family, table, chain, err, strings.TrimSpace(errOut.String()))
	}
	return out.String(), nil
}

func hashName(prefix, key string) string {
	sum := sha256.Sum256([]byte(key))
	return prefix + hex.EncodeToString(sum[:8])
}

// spoofChainName is the chain holding a port's MAC rules.
func spoofChainName(port string) string { return hashName("spoof_", port) }

// masqChainName is the chain masquerading one attachment's addresses.
func masqChainName(attachment string) string { return hashName("masq_", attachment) }

// nftComment makes a rule comment naming the attachment.
func nftComment(tag string) string {
	tag = strings.Map(func(r rune) rune {
		if r == '"' || r == '\\' || r < ' ' || r > '~' {
			return '_'
		}
		return r
	}, tag)
	if len(tag) > 120 {
		tag = tag[:120]
	}
	return `comment "` + tag + `"`
}

func spoofBase(b *strings.Builder) {
	fmt.Fprintf(b, "add table bridge %s\n", spoofTable)
	fmt.Fprintf(b, "add map bridge %s ports { type ifname : verdict ; }\n", spoofTable)
}

// spoofAddScript permits only frames sourced from mac to enter the bridge
// through port (Ethernet source and ARP sender).
func spoofAddScript(port string, mac net.HardwareAddr, tag string) string {
	var b strings.Builder
	spoofBase(&b)
	fmt.Fprintf(&b, "add chain bridge %s prerouting { type filter hook prerouting priority -300 ; policy accept ; }\n", spoofTable)
	fmt.Fprintf(&b, "flush chain bridge %s prerouting\n", spoofTable)
	fmt.Fprintf(&b, "add rule bridge %s prerouting iifname vmap @ports\n", spoofTable)
	c := spoofChainName(port)
	fmt.Fprintf(&b, "add chain bridge %s %s\n", spoofTable, c)
	fmt.Fprintf(&b, "flush chain bridge %s %s\n", spoofTable, c)
	fmt.Fprintf(&b, "add rule bridge %s %s ether saddr != %s drop %s\n", spoofTable, c, mac, nftComment(tag))
	fmt.Fprintf(&b, "add rule bridge %s %s arp saddr ether != %s drop %s\n", spoofTable, c, mac, nftComment(tag))
	fmt.Fprintf(&b, "add element bridge %s ports { %q : jump %s }\n", spoofTable, port, c)
	return b.String()
}

// spoofDelScript removes a port's rules; it succeeds whether or not they
// exist (each object is added before it is deleted, in one transaction).
func spoofDelScript(port string) string {
	var b strings.Builder
	spoofBase(&b)
	c := spoofChainName(port)
	fmt.Fprintf(&b, "add chain bridge %s %s\n", spoofTable, c)
	fmt.Fprintf(&b, "add element bridge %s ports { %q : jump %s }\n", spoofTable, port, c)
	fmt.Fprintf(&b, "delete element bridge %s ports { %q }\n", spoofTable, port)
	fmt.Fprintf(&b, "flush chain bridge %s %s\n", spoofTable, c)
	fmt.Fprintf(&b, "delete chain bridge %s %s\n", spoofTable, c)
	return b.String()
}

// checkSpoofChain verifies the port's chain exists and pins mac.
func checkSpoofChain(ctx context.Context, port string, mac net.HardwareAddr) error {
	out, err := listNFTChain(ctx, "bridge", spoofTable, spoofChainName(port))
	if err != nil {
		return err
	}
	if out == "" {
		return fmt.Errorf("macspoofchk rules for %s are missing", port)
	}
	if !strings.Contains(out, "ether saddr != "+mac.String()+" drop") {
		return fmt.Errorf("macspoofchk rules for %s do not pin %s", port, mac)
	}
	p, err := nftPath()
	if err != nil {
		return err
	}
	m, err := exec.CommandContext(ctx, p, "list", "map", "bridge", spoofTable, "ports").CombinedOutput()
	if err != nil {
		return fmt.Errorf("nft list map: %w: %s", err, strings.TrimSpace(string(m)))
	}
	if !strings.Contains(string(m), fmt.Sprintf("%q : jump %s", port, spoofChainName(port))) {
		return fmt.Errorf("macspoofchk rules for %s are not hooked into the bridge", port)
	}
	return nil
}

func natBase(b *strings.Builder) {
	fmt.Fprintf(b, "add table inet %s\n", natTable)
	fmt.Fprintf(b, "add map inet %s masq4 { type ipv4_addr : verdict ; }\n", natTable)
	fmt.Fprintf(b, "add map inet %s masq6 { type ipv6_addr : verdict ; }\n", natTable)
}

// masqAddScript masquerades traffic from each address in addrs leaving its
// own subnet (multicast excepted).
func masqAddScript(attachment string, addrs []*net.IPNet) string {
	var b strings.Builder
	natBase(&b)
	fmt.Fprintf(&b, "add chain inet %s postrouting { type nat hook postrouting priority 100 ; policy accept ; }\n", natTable)
	fmt.Fprintf(&b, "flush chain inet %s postrouting\n", natTable)
	fmt.Fprintf(&b, "add rule inet %s postrouting ip saddr vmap @masq4\n", natTable)
	fmt.Fprintf(&b, "add rule inet %s postrouting ip6 saddr vmap @masq6\n", natTable)
	c := masqChainName(attachment)
	fmt.Fprintf(&b, "add chain inet %s %s\n", natTable, c)
	fmt.Fprintf(&b, "flush chain inet %s %s\n", natTable, c)
	for _, a := range addrs {
		subnet := &net.IPNet{IP: a.IP.Mask(a.Mask), Mask: a.Mask}
		if a.IP.To4() != nil {
			fmt.Fprintf(&b, "add rule inet %s %s ip daddr != %s ip daddr != 224.0.0.0/4 masquerade %s\n", natTable, c, subnet, nftComment(attachment))
			fmt.Fprintf(&b, "add element inet %s masq4 { %s : jump %s }\n", natTable, a.IP, c)
		} else {
			fmt.Fprintf(&b, "add rule inet %s %s ip6 daddr != %s ip6 daddr != ff00::/8 masquerade %s\n", natTable, c, subnet, nftComment(attachment))
			fmt.Fprintf(&b, "add element inet %s masq6 { %s : jump %s }\n", natTable, a.IP, c)
		}
	}
	return b.String()
}

// masqDelScript removes an attachment's masquerade chain and map entries,
// whether or not they exist.
func masqDelScript(attachment string, ips []net.IP) string {
	var b strings.Builder
	natBase(&b)
	c := masqChainName(attachment)
	fmt.Fprintf(&b, "add chain inet %s %s\n", natTable, c)
	for _, ip := range ips {
		m := "masq6"
		if ip.To4() != nil {
			m = "masq4"
		}
		fmt.Fprintf(&b, "add element inet %s %s { %s : jump %s }\n", natTable, m, ip, c)
		fmt.Fprintf(&b, "delete element inet %s %s { %s }\n", natTable, m, ip)
	}
	fmt.Fprintf(&b, "flush chain inet %s %s\n", natTable, c)
	fmt.Fprintf(&b, "delete chain inet %s %s\n", natTable, c)
	return b.String()
}

// RemoveUnusedTables deletes the plugin's nftables tables when no
// attachment uses them any more (no port in the spoof-check map, no masquerade
// chain), so a host whose last attachment is gone looks as before the first.
// Call it when no ADD can run concurrently (an agent's or a lab's teardown).
func RemoveUnusedTables(ctx context.Context) error {
	p, err := nftPath()
	if err != nil {
		return err
	}
	var errs []error
	for _, t := range []struct{ family, name string }{{"bridge", spoofTable}, {"inet", natTable}} {
		out, err := exec.CommandContext(ctx, p, "list", "table", t.family, t.name).CombinedOutput()
		if err != nil {
			continue // no such table
		}
		if strings.Contains(string(out), "elements =") || strings.Contains(string(out), "masquerade") {
			continue
		}
		if err := runNFT(ctx, fmt.Sprintf("delete table %s %s\n", t.family, t.name)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
