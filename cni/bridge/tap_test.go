package bridge_test

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/cni/bridge"
)

func TestParseNetConfFromNAD(t *testing.T) {
	single := `{"cniVersion":"0.3.1","name":"br1-vlan","type":"cnv-bridge","bridge":"br1","vlan":100,"macspoofchk":true,"mtu":9000}`
	n, err := bridge.ParseNetConf([]byte(single))
	if err != nil {
		t.Fatal(err)
	}
	if n.Bridge != "br1" || n.VLAN != 100 || !n.MACSpoofCheck || n.MTU != 9000 || !n.PreserveDefaultVLAN {
		t.Fatalf("parsed %+v", n)
	}
	list := `{"cniVersion":"0.4.0","name":"trunky","plugins":[
		{"type":"bridge","bridge":"br2","vlanTrunk":[{"id":5},{"minID":10,"maxID":12}],"preserveDefaultVlan":false},
		{"type":"tuning"}]}`
	n, err = bridge.ParseNetConf([]byte(list))
	if err != nil {
		t.Fatal(err)
	}
	if n.Name != "trunky" || n.CNIVersion != "0.4.0" || n.Bridge != "br2" || len(n.Trunk) != 2 ||
		n.Trunk[1] != (bridge.VLANRange{Min: 10, Max: 12}) || n.PreserveDefaultVLAN {
		t.Fatalf("parsed %+v", n)
	}
	for _, bad := range []string{
		`{"cniVersion":"0.3.1","name":"x","type":"macvlan"}`,
		`{"cniVersion":"0.3.1","name":"x","plugins":[]}`,
		`{"name":"x","type":"cnv-bridge","vlan":-1}`,
		`not json`,
	} {
		_, err := bridge.ParseNetConf([]byte(bad))
		var ce *types.Error
		if err == nil || !errors.As(err, &ce) {
			t.Errorf("ParseNetConf(%s) = %v, want a CNI error", bad, err)
		}
	}
}

func TestAttachTap(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	conf, err := bridge.ParseNetConf([]byte(`{"cniVersion":"1.0.0","name":"vmnet","type":"cnv-bridge","bridge":"vmbr0","mtu":1400,"macspoofchk":true,"portIsolation":true}`))
	if err != nil {
		t.Fatal(err)
	}
	conf.StateDir = e.stateDir
	mac, _ := net.ParseMAC("02:54:00:00:00:01")
	var a *bridge.Attachment
	err = e.host.Do(func() error {
		var err error
		if a, err = bridge.AttachTap(ctx, conf, "tapvm0", mac, 64055); err != nil {
			return err
		}
		// Idempotent: a second attach (agent restart) reconfigures.
		_, err = bridge.AttachTap(ctx, conf, "tapvm0", mac, 64055)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if a.Port != "tapvm0" || a.MTU != 1400 || a.Bridge != "vmbr0" {
		t.Fatalf("attachment %+v", a)
	}
	var tap *netlink.Tuntap
	var isolated bool
	_ = e.host.Do(func() error {
		l, err := netlink.LinkByName("tapvm0")
		if err != nil {
			return err
		}
		tap, _ = l.(*netlink.Tuntap)
		br, _ := netlink.LinkByName("vmbr0")
		if tap == nil || l.Attrs().MasterIndex != br.Attrs().Index {
			t.Errorf("tapvm0 is %T, master %d", l, l.Attrs().MasterIndex)
		}
		pi, err := netlink.LinkGetProtinfo(l)
		isolated = err == nil && pi.Isolated
		return nil
	})
	if tap == nil {
		t.Fatal("no tap")
	}
	if tap.Owner != 64055 || tap.Attrs().MTU != 1400 || tap.Attrs().HardwareAddr.String() != "fe:54:00:00:00:01" || !isolated {
		t.Fatalf("tap owner %d mtu %d mac %s isolated %v", tap.Owner, tap.Attrs().MTU, tap.Attrs().HardwareAddr, isolated)
	}
	if rs := e.ruleset(); !strings.Contains(rs, "ether saddr != 02:54:00:00:00:01 drop") || !strings.Contains(rs, `"tapvm0" : jump`) {
		t.Fatalf("spoof rules missing:\n%s", rs)
	}
	// The caller's record of the tap is the only one: nothing is kept
	// here, and detaching with a config that no longer says macspoofchk
	// (or an empty one, as a teardown has) still finds the rules.
	if _, err := os.Stat(filepath.Join(e.stateDir, "tap")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("AttachTap kept a record of its own: %v", err)
	}
	bare := &bridge.NetConf{StateDir: e.stateDir}
	for range 2 {
		if err := e.host.Do(func() error { return bridge.DetachTap(ctx, bare, "tapvm0") }); err != nil {
			t.Fatalf("DetachTap: %v", err)
		}
	}
	if _, ok := e.hostLinks()["tapvm0"]; ok {
		t.Fatal("tap left after DetachTap")
	}
	if rs := e.ruleset(); strings.Contains(rs, "spoof_") || strings.Contains(rs, "tapvm0") {
		t.Fatalf("rules left:\n%s", rs)
	}

	// Without macspoofchk no rule is made, and detaching makes no table.
	if err := e.host.Do(func() error { return bridge.RemoveUnusedTables(ctx) }); err != nil {
		t.Fatal(err)
	}
	plain := *conf
	plain.MACSpoofCheck = false
	err = e.host.Do(func() error {
		if _, err := bridge.AttachTap(ctx, &plain, "tapvm2", mac, 0); err != nil {
			return err
		}
		return bridge.DetachTap(ctx, &plain, "tapvm2")
	})
	if err != nil {
		t.Fatal(err)
	}
	if rs := e.ruleset(); strings.Contains(rs, "nodevirt_bridge") {
		t.Fatalf("a detach without rules made a table:\n%s", rs)
	}

	// A VLAN the kernel cannot filter fails and leaves no tap behind.
	if !vlanFilteringWorks(t) {
		conf.VLAN = 10
		err := e.host.Do(func() error {
			_, err := bridge.AttachTap(ctx, conf, "tapvm1", mac, 0)
			return err
		})
		if err == nil || !strings.Contains(err.Error(), "vlan=10") {
			t.Fatalf("AttachTap with vlan on this kernel: %v", err)
		}
		if _, ok := e.hostLinks()["tapvm1"]; ok {
			t.Fatal("failed AttachTap left its tap")
		}
	}
}
