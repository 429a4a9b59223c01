package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// pingUserData configures the guest's address (nodevirt.ip= in user-data)
// and pings the peer in the background until it answers, so neither guest
// has to wait for the other to boot.
func pingUserData(self, peer string) string {
	return fmt.Sprintf(`#!/bin/sh
# nodevirt.ip=%s/24
(
  i=0
  while [ $i -lt 120 ]; do
    if ping -c 1 -W 1 %s >/dev/null 2>&1; then echo E2E-PING-OK %s; exit 0; fi
    i=$((i + 1)); sleep 1
  done
  echo E2E-PING-FAILED %s
) &
`, self, peer, peer, peer)
}

// TestBridgePing: two VMs whose NICs use the bridge binding on one
// NetworkAttachmentDefinition reach each other, each with its MAC from the
// pool. (VMs, not bare VMIs: the MAC pool serves VMs, as kubemacpool does.)
func TestBridgePing(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	nad, br := n.bridgeNetwork("ping-net")
	addrs := map[string][2]string{"left": {"10.231.0.1", "10.231.0.2"}, "right": {"10.231.0.2", "10.231.0.1"}}
	for name, a := range addrs {
		n.createVM(n.newVM(name, kubevirtv1.RunStrategyAlways, withBridge(nad), withUserData(pingUserData(a[0], a[1]))))
	}
	macs := map[string]string{}
	for name, a := range addrs {
		vmi := n.waitVMIOfVM(name, 2*time.Minute)
		_, mac := interfaceMAC(vmi)
		if mac == "" {
			t.Errorf("vmi %s has no MAC in its spec (clusterbrain/macpool did not assign one)", name)
		}
		macs[name] = mac
		s := n.serial(name)
		s.expect(`NODEVIRT-IP eth0 `+a[0]+`/24`, bootTimeout)
		s.expect(`E2E-PING-(OK|FAILED) `+a[1], 150*time.Second)
		if !s.contains(`E2E-PING-OK ` + a[1]) {
			t.Errorf("%s (%s) could not ping %s over bridge %s", name, a[0], a[1], br)
		}
	}
	if macs["left"] != "" && strings.EqualFold(macs["left"], macs["right"]) {
		t.Errorf("both VMIs got MAC %s", macs["left"])
	}
}
