#!/bin/sh
# Runs inside the netguest VM (Debian cloud kernel: bridge VLAN filtering and
# nf_tables bridge family). Drives the cnv-bridge plugin through cnidrv and
# prints "NETGUEST PASS" or "NETGUEST FAIL: <why>".
IP=/usr/sbin/ip
BRIDGE=/usr/sbin/bridge
NFT=/usr/sbin/nft
export CNI_PATH=/cni

fail() {
	echo "NETGUEST FAIL: $*"
	$BRIDGE vlan show
	$NFT list ruleset
	exit 1
}
step() { echo "netguest: $*"; }

# conf <file> <network> <bridge> <vlan> <address>
conf() {
	cat >"/run/$1.json" <<EOF
{"cniVersion":"1.1.0","name":"$2","type":"cnv-bridge","bridge":"$3","vlan":$4,
 "macspoofchk":true,"preserveDefaultVlan":false,"stateDir":"/run/nvstate",
 "ipam":{"type":"static","addresses":[{"address":"$5/24"}]}}
EOF
}
add() { cnidrv add "/run/$1.json" "$1" "$1" >/run/$1.result || fail "ADD $1: $(cat /run/$1.result)"; }
del() { cnidrv del "/run/$1.json" "$1" "$1" || fail "DEL $1"; }
pings() { $IP netns exec "$1" ping -c 1 -W 2 "$2" >/dev/null 2>&1; }
nports() { $BRIDGE link show | grep -c "nvb" ; }
njumps() { $NFT list map bridge nodevirt_bridge ports 2>/dev/null | grep -o "jump" | wc -l; }

for n in a b c d e f g; do $IP netns add $n || fail "netns add $n"; done

step "VLAN isolation on a bridge the plugin creates"
conf a v100 br0 100 10.0.0.1
conf b v100 br0 100 10.0.0.2
conf c v200 br0 200 10.0.0.3
conf d v100 br0 100 10.0.0.4
for n in a b c d; do add $n; done
$IP -d link show br0 | grep -q "vlan_filtering 1" || fail "br0 was created without VLAN filtering"
pings a 10.0.0.2 || fail "a -> b on VLAN 100 does not talk"
pings a 10.0.0.3 && fail "a (VLAN 100) reached c (VLAN 200)"
pings c 10.0.0.1 && fail "c (VLAN 200) reached a (VLAN 100)"
$BRIDGE vlan show | grep -q "200 PVID Egress Untagged" || fail "VLAN 200 port entry missing"
[ "$($BRIDGE vlan show | grep -c '^nvb.* 1 ')" = 0 ] || fail "default VLAN 1 left on a port"
cnidrv check /run/a.json a a || fail "CHECK a"

step "spoof check drops a forged source MAC"
pings d 10.0.0.1 || fail "d -> a does not talk before forging"
real=$($IP -n d link show eth0 | awk '/link\/ether/ {print $2}')
$IP -n d link set eth0 address 02:66:66:66:66:66
$IP -n d neigh flush all
pings d 10.0.0.1 && fail "forged MAC got through"
$IP -n d link set eth0 address "$real"
pings d 10.0.0.1 || fail "d -> a after restoring its MAC"

step "VLAN isolation on an administrator's bridge without filtering"
$IP link add br1 type bridge || fail "make br1"
$IP link set br1 up
conf e v100b br1 100 10.1.0.1
conf f v100b br1 100 10.1.0.2
conf g v300b br1 300 10.1.0.3
for n in e f g; do add $n; done
$IP -d link show br1 | grep -q "vlan_filtering 1" || fail "br1 did not get VLAN filtering"
pings e 10.1.0.2 || fail "e -> f on VLAN 100 (br1) does not talk"
pings e 10.1.0.3 && fail "e (VLAN 100) reached g (VLAN 300) on br1"

step "DEL after the netns is gone leaves no port or rule"
before=$(njumps)
$IP netns del b
del b
[ "$(njumps)" = $((before - 1)) ] || fail "spoof rule of b left: $(njumps) of $before"
[ "$(nports)" = 6 ] || fail "port of b left: $(nports) ports"
del b

step "GC removes attachments not in the valid list"
$IP netns del d
cnidrv gc /run/a.json a || fail "GC v100"
[ "$(nports)" = 5 ] || fail "GC left d's port: $(nports) ports"
ls /run/nvstate/net/v100 | grep -q "^d_" && fail "GC left d's record"

step "attachments without IPAM are up after ADD and talk on their VLAN"
confl2() {
	cat >"/run/$1.json" <<EOF
{"cniVersion":"1.1.0","name":"$2","type":"cnv-bridge","bridge":"$3","vlan":$4,"macspoofchk":true,"stateDir":"/run/nvstate"}
EOF
}
for n in h i j; do $IP netns add $n || fail "netns add $n"; done
confl2 h l2v400 br0 400
confl2 i l2v400 br0 400
confl2 j l2v500 br0 500
for n in h i j; do add $n; done
for n in h i j; do
	$IP -n $n -o link show eth0 | grep -q "[<,]UP[,>]" || fail "eth0 of $n is down after ADD: $($IP -n $n -o link show eth0)"
done
$IP -n h addr add 10.4.0.1/24 dev eth0
$IP -n i addr add 10.4.0.2/24 dev eth0
$IP -n j addr add 10.4.0.3/24 dev eth0
pings h 10.4.0.2 || fail "h -> i on VLAN 400 without IPAM does not talk"
pings h 10.4.0.3 && fail "h (VLAN 400) reached j (VLAN 500)"

step "DEL of everything leaves nothing"
for n in a c e f g h i j; do del $n; done
[ "$(nports)" = 0 ] || fail "ports left: $(nports)"
[ "$(njumps)" = 0 ] || fail "spoof rules left"
$NFT list ruleset | grep -q "spoof_" && fail "spoof chains left"
$BRIDGE vlan show | grep -q nvb && fail "VLAN entries left"
[ -z "$(find /run/nvstate/net -type f)" ] || fail "state records left: $(find /run/nvstate/net -type f)"

echo "NETGUEST PASS"
