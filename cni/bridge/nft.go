package bridge

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The rules live in two tables of their own. Every attachment gets one chain
// named after a hash of its port (spoof) or attachment (masquerade); a
// verdict map in the base chain jumps to it. Adding and removing an
// attachment is therefore one atomic nftables transaction without rule
// handles, and removal works from the recorded names alone, without the
// netns. The transactions go to the kernel over netlink (no nft process):
// each is one batch, sent on a socket opened in the calling thread's
// network namespace.
const (
	spoofTable = "nodevirt_bridge"
	natTable   = "nodevirt_bridge_nat"

	spoofMap  = "ports"
	spoofBase = "prerouting"
	masq4Map  = "masq4"
	masq6Map  = "masq6"
	masqBase  = "postrouting"

	// ifNameLen is the size of an ifname key (IFNAMSIZ, zero padded).
	ifNameLen = unix.IFNAMSIZ
)

func hashName(prefix, key string) string {
	sum := sha256.Sum256([]byte(key))
	return prefix + hex.EncodeToString(sum[:8])
}

// spoofChainName is the chain holding a port's MAC rules.
func spoofChainName(port string) string { return hashName("spoof_", port) }

// masqChainName is the chain masquerading one attachment's addresses.
func masqChainName(attachment string) string { return hashName("masq_", attachment) }

// ruleComment is a rule's user data naming the attachment, shown by
// `nft list` as its comment.
func ruleComment(tag string) []byte {
	tag = strings.Map(func(r rune) rune {
		if r == '"' || r == '\\' || r < ' ' || r > '~' {
			return '_'
		}
		return r
	}, tag)
	if len(tag) > 120 {
		tag = tag[:120]
	}
	return userdata.AppendString(nil, userdata.TypeComment, tag)
}

func ifNameKey(name string) []byte {
	b := make([]byte, ifNameLen)
	copy(b, name)
	return b
}

// nftBatch collects one transaction; commit sends it.
type nftBatch struct{ c *nftables.Conn }

// tableObjects are a table's shared objects, which ensure adds to a batch.
type tableObjects interface{ ensure(*nftBatch) error }

// newNFTBatch starts a transaction that first ensures o's objects exist.
func newNFTBatch(o tableObjects) (*nftBatch, error) {
	c, err := nftables.New()
	if err != nil {
		return nil, fmt.Errorf("nftables netlink: %w", err)
	}
	b := &nftBatch{c: c}
	if err := o.ensure(b); err != nil {
		return nil, err
	}
	return b, nil
}

func (b *nftBatch) commit(what string) error {
	if err := b.c.Flush(); err != nil {
		return fmt.Errorf("nftables %s: %w", what, err)
	}
	return nil
}

// spoofObjects are the shared objects of the spoof-check table.
// baseChain adds (or keeps) a table's hooked chain with an accept policy
// and empties it, for the caller to fill again.
func (b *nftBatch) baseChain(t *nftables.Table, name string, typ nftables.ChainType, hook *nftables.ChainHook, prio *nftables.ChainPriority) *nftables.Chain {
	policy := nftables.ChainPolicyAccept
	c := b.c.AddChain(&nftables.Chain{Table: t, Name: name, Type: typ, Hooknum: hook, Priority: prio, Policy: &policy})
	b.c.FlushChain(c)
	return c
}

// jumpTo sets set[key] to a jump to chain c.
func (b *nftBatch) jumpTo(s *nftables.Set, key []byte, c *nftables.Chain) error {
	return b.c.SetAddElements(s, []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: c.Name}}})
}

// dropJump removes set[key], whether or not it is there: the element is
// added first, so that deleting it cannot fail in the same transaction.
func (b *nftBatch) dropJump(s *nftables.Set, key []byte, c *nftables.Chain) error {
	if err := b.jumpTo(s, key, c); err != nil {
		return err
	}
	return b.c.SetDeleteElements(s, []nftables.SetElement{{Key: key}})
}

// dropChain removes chain c (added first, for the same reason).
func (b *nftBatch) dropChain(c *nftables.Chain) {
	b.c.FlushChain(c)
	b.c.DelChain(c)
}

type spoofObjects struct {
	table *nftables.Table
	ports *nftables.Set
}

func spoofTableObjects() spoofObjects {
	t := &nftables.Table{Family: nftables.TableFamilyBridge, Name: spoofTable}
	return spoofObjects{
		table: t,
		// ifname keys are strings: host byte order, as nft records it.
		ports: &nftables.Set{Table: t, ID: 1, Name: spoofMap, IsMap: true,
			KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict, KeyByteOrder: binaryutil.NativeEndian},
	}
}

func (o spoofObjects) chain(port string) *nftables.Chain {
	return &nftables.Chain{Table: o.table, Name: spoofChainName(port)}
}

// ensure adds the table and the map (both idempotent: no NLM_F_EXCL).
func (o spoofObjects) ensure(b *nftBatch) error {
	b.c.AddTable(o.table)
	if err := b.c.AddSet(o.ports, nil); err != nil {
		return fmt.Errorf("nftables map %s: %w", spoofMap, err)
	}
	return nil
}

// addSpoofRules permits only frames sourced from mac to enter the bridge
// through port (Ethernet source, and ARP sender of untagged ARP). It
// replaces whatever an earlier ADD of the same port left.
func addSpoofRules(port string, mac net.HardwareAddr, tag string) error {
	if len(mac) != 6 {
		return fmt.Errorf("macspoofchk on %s: %q is not an Ethernet MAC", port, mac)
	}
	o := spoofTableObjects()
	b, err := newNFTBatch(o)
	if err != nil {
		return err
	}
	base := b.baseChain(o.table, spoofBase, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftables.ChainPriorityRaw)
	b.c.AddRule(&nftables.Rule{Table: o.table, Chain: base, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Lookup{SourceRegister: 1, SetName: spoofMap, SetID: o.ports.ID, DestRegister: 0, IsDestRegSet: true},
	}})
	c := b.c.AddChain(o.chain(port))
	b.c.FlushChain(c)
	comment := ruleComment(tag)
	// ether saddr != mac drop
	b.c.AddRule(&nftables.Rule{Table: o.table, Chain: c, UserData: comment, Exprs: []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte(mac)},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}})
	// arp saddr ether != mac drop (ether type arp, sender hardware address)
	b.c.AddRule(&nftables.Rule{Table: o.table, Chain: c, UserData: comment, Exprs: []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0x08, 0x06}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 6},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte(mac)},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}})
	if err := b.jumpTo(o.ports, ifNameKey(port), c); err != nil {
		return fmt.Errorf("nftables element %s: %w", port, err)
	}
	return b.commit("add macspoofchk rules for " + port)
}

// delSpoofRules removes a port's rules; it succeeds whether or not they
// exist (each object is added before it is deleted, in one transaction).
func delSpoofRules(port string) error {
	o := spoofTableObjects()
	b, err := newNFTBatch(o)
	if err != nil {
		return err
	}
	c := b.c.AddChain(o.chain(port))
	if err := b.dropJump(o.ports, ifNameKey(port), c); err != nil {
		return fmt.Errorf("nftables element %s: %w", port, err)
	}
	b.dropChain(c)
	return b.commit("remove macspoofchk rules of " + port)
}

// delSpoofRulesIfAny is delSpoofRules for a caller that does not know
// whether the port ever had rules: with no spoof-check table on the host
// there is nothing to remove, and none is made.
func delSpoofRulesIfAny(port string) error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables netlink: %w", err)
	}
	if _, err := c.ListTableOfFamily(spoofTable, nftables.TableFamilyBridge); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("nftables table %s: %w", spoofTable, err)
	}
	return delSpoofRules(port)
}

// checkSpoofRules verifies the port's chain exists, drops frames not from
// mac, and is what the map sends the port's frames to.
func checkSpoofRules(port string, mac net.HardwareAddr) error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables netlink: %w", err)
	}
	o := spoofTableObjects()
	if _, err := c.ListTableOfFamily(spoofTable, nftables.TableFamilyBridge); err != nil {
		return fmt.Errorf("macspoofchk rules for %s are missing (no table %s)", port, spoofTable)
	}
	rules, err := c.GetRules(o.table, o.chain(port))
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("nftables rules of %s: %w", port, err)
	}
	if len(rules) == 0 {
		return fmt.Errorf("macspoofchk rules for %s are missing", port)
	}
	pinned := false
	for _, r := range rules {
		if dropsOtherSource(r.Exprs, mac) {
			pinned = true
		}
	}
	if !pinned {
		return fmt.Errorf("macspoofchk rules for %s do not pin %s", port, mac)
	}
	elems, err := c.GetSetElements(o.ports)
	if err != nil {
		return fmt.Errorf("nftables map %s: %w", spoofMap, err)
	}
	key := ifNameKey(port)
	for _, e := range elems {
		if bytes.Equal(e.Key, key) && jumpTarget(e.Val) == spoofChainName(port) {
			return nil
		}
	}
	return fmt.Errorf("macspoofchk rules for %s are not hooked into the bridge", port)
}

// jumpTarget decodes a verdict map element's data (as the library returns
// it: the attributes inside NFTA_DATA_VERDICT) and returns the chain it
// jumps to, or "".
func jumpTarget(val []byte) string {
	ad, err := netlink.NewAttributeDecoder(val)
	if err != nil {
		return ""
	}
	ad.ByteOrder = binary.BigEndian
	var code int32
	var chain string
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_VERDICT_CODE:
			code = int32(ad.Uint32())
		case unix.NFTA_VERDICT_CHAIN:
			chain = ad.String()
		}
	}
	if ad.Err() != nil || code != unix.NFT_JUMP {
		return ""
	}
	return chain
}

// dropsOtherSource reports whether exprs are "ether saddr != mac drop".
func dropsOtherSource(exprs []expr.Any, mac net.HardwareAddr) bool {
	if len(exprs) != 3 {
		return false
	}
	p, ok1 := exprs[0].(*expr.Payload)
	c, ok2 := exprs[1].(*expr.Cmp)
	v, ok3 := exprs[2].(*expr.Verdict)
	return ok1 && ok2 && ok3 &&
		p.Base == expr.PayloadBaseLLHeader && p.Offset == 6 && p.Len == 6 &&
		c.Op == expr.CmpOpNeq && bytes.Equal(c.Data, mac) && v.Kind == expr.VerdictDrop
}

// natObjects are the shared objects of the masquerade table.
type natObjects struct {
	table        *nftables.Table
	masq4, masq6 *nftables.Set
}

func natTableObjects() natObjects {
	t := &nftables.Table{Family: nftables.TableFamilyINet, Name: natTable}
	return natObjects{
		table: t,
		masq4: &nftables.Set{Table: t, ID: 1, Name: masq4Map, IsMap: true,
			KeyType: nftables.TypeIPAddr, DataType: nftables.TypeVerdict},
		masq6: &nftables.Set{Table: t, ID: 2, Name: masq6Map, IsMap: true,
			KeyType: nftables.TypeIP6Addr, DataType: nftables.TypeVerdict},
	}
}

func (o natObjects) ensure(b *nftBatch) error {
	b.c.AddTable(o.table)
	for _, s := range []*nftables.Set{o.masq4, o.masq6} {
		if err := b.c.AddSet(s, nil); err != nil {
			return fmt.Errorf("nftables map %s: %w", s.Name, err)
		}
	}
	return nil
}

// mapOf returns the map for ip's family and ip's key bytes.
func (o natObjects) mapOf(ip net.IP) (*nftables.Set, []byte) {
	if v4 := ip.To4(); v4 != nil {
		return o.masq4, v4
	}
	return o.masq6, ip.To16()
}

// ipFamily is what the masquerade rules need of an IP version: its nfproto,
// the header offsets of source and destination, the address length and
// the multicast range.
type ipFamily struct {
	nfproto      byte
	saddr, daddr uint32
	addrLen      uint32
	multicast    *net.IPNet
}

var (
	family4 = ipFamily{nfproto: unix.NFPROTO_IPV4, saddr: 12, daddr: 16, addrLen: 4,
		multicast: &net.IPNet{IP: net.IPv4(224, 0, 0, 0).To4(), Mask: net.CIDRMask(4, 32)}}
	family6 = ipFamily{nfproto: unix.NFPROTO_IPV6, saddr: 8, daddr: 24, addrLen: 16,
		multicast: &net.IPNet{IP: net.ParseIP("ff00::"), Mask: net.CIDRMask(8, 128)}}
)

// notInPrefix matches packets whose destination is outside p, encoded as
// nft encodes it (so that nft lists it as "daddr != p"): a byte-aligned
// prefix compares only its bytes, any other the masked whole address.
func (f ipFamily) notInPrefix(p *net.IPNet) []expr.Any {
	ones, _ := p.Mask.Size()
	ip := p.IP.To4()
	if f.addrLen == 16 {
		ip = p.IP.To16()
	}
	n := uint32(ones / 8)
	if ones%8 != 0 {
		n = f.addrLen
	}
	out := []expr.Any{&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: f.daddr, Len: n}}
	if ones%8 != 0 {
		out = append(out, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: n,
			Mask: append([]byte(nil), p.Mask[:n]...), Xor: make([]byte, n)})
	}
	want := make([]byte, n)
	for i := range want {
		want[i] = ip[i] & p.Mask[i]
	}
	return append(out, &expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: want})
}

func (f ipFamily) match() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{f.nfproto}},
	}
}

// addMasqRules masquerades traffic from each address in addrs leaving its
// own subnet (multicast excepted).
func addMasqRules(attachment string, addrs []*net.IPNet) error {
	o := natTableObjects()
	b, err := newNFTBatch(o)
	if err != nil {
		return err
	}
	base := b.baseChain(o.table, masqBase, nftables.ChainTypeNAT, nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource)
	for _, m := range []struct {
		f ipFamily
		s *nftables.Set
	}{{family4, o.masq4}, {family6, o.masq6}} {
		exprs := append(m.f.match(),
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: m.f.saddr, Len: m.f.addrLen},
			&expr.Lookup{SourceRegister: 1, SetName: m.s.Name, SetID: m.s.ID, DestRegister: 0, IsDestRegSet: true})
		b.c.AddRule(&nftables.Rule{Table: o.table, Chain: base, Exprs: exprs})
	}
	c := b.c.AddChain(&nftables.Chain{Table: o.table, Name: masqChainName(attachment)})
	b.c.FlushChain(c)
	comment := ruleComment(attachment)
	for _, a := range addrs {
		f := family4
		if a.IP.To4() == nil {
			f = family6
		}
		subnet := &net.IPNet{IP: a.IP.Mask(a.Mask), Mask: a.Mask}
		if ones, _ := subnet.Mask.Size(); ones > 0 {
			exprs := f.match()
			exprs = append(exprs, f.notInPrefix(subnet)...)
			exprs = append(exprs, f.notInPrefix(f.multicast)...)
			exprs = append(exprs, &expr.Masq{})
			b.c.AddRule(&nftables.Rule{Table: o.table, Chain: c, UserData: comment, Exprs: exprs})
		}
		s, key := o.mapOf(a.IP)
		if err := b.jumpTo(s, key, c); err != nil {
			return fmt.Errorf("nftables element %s: %w", a.IP, err)
		}
	}
	return b.commit("add ipMasq rules for " + attachment)
}

// delMasqRules removes an attachment's masquerade chain and map entries,
// whether or not they exist.
func delMasqRules(attachment string, ips []net.IP) error {
	o := natTableObjects()
	b, err := newNFTBatch(o)
	if err != nil {
		return err
	}
	c := b.c.AddChain(&nftables.Chain{Table: o.table, Name: masqChainName(attachment)})
	for _, ip := range ips {
		s, key := o.mapOf(ip)
		if err := b.dropJump(s, key, c); err != nil {
			return fmt.Errorf("nftables element %s: %w", ip, err)
		}
	}
	b.dropChain(c)
	return b.commit("remove ipMasq rules of " + attachment)
}

// RemoveUnusedTables deletes the plugin's nftables tables when no
// attachment uses them any more (no element in their maps), so a host whose
// last attachment is gone looks as before the first. Call it when no ADD
// can run concurrently (an agent's or a lab's teardown).
func RemoveUnusedTables(_ context.Context) error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables netlink: %w", err)
	}
	spoof, nat := spoofTableObjects(), natTableObjects()
	var errs []error
	for _, t := range []struct {
		table *nftables.Table
		maps  []*nftables.Set
	}{{spoof.table, []*nftables.Set{spoof.ports}}, {nat.table, []*nftables.Set{nat.masq4, nat.masq6}}} {
		if _, err := c.ListTableOfFamily(t.table.Name, t.table.Family); err != nil {
			continue // no such table
		}
		used := false
		for _, m := range t.maps {
			elems, err := c.GetSetElements(m)
			if err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("nftables map %s: %w", m.Name, err))
				used = true
			}
			used = used || len(elems) > 0
		}
		if used {
			continue
		}
		c.DelTable(t.table)
		if err := c.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("nftables delete table %s: %w", t.table.Name, err))
		}
	}
	return errors.Join(errs...)
}

// nftablesUsable asks the kernel for the tables of the bridge family, which
// fails when nf_tables is missing or the caller lacks CAP_NET_ADMIN.
func nftablesUsable() error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables netlink: %w", err)
	}
	if _, err := c.ListTablesOfFamily(nftables.TableFamilyBridge); err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	return nil
}
