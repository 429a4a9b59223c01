package bridge

import (
	"encoding/json"
	"errors"
	"net"
	"reflect"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
)

// FuzzNetConf feeds arbitrary network configs (what a
// NetworkAttachmentDefinition's spec.config or a runtime's stdin holds) and
// CNI_ARGS through the plugin's parsers. Nothing may panic; a refusal must
// be a CNI error object; an accepted config must have its defaults applied
// and only valid fields, and must load again unchanged from its own JSON.
// A host-local IPAM section the plugin serves itself must describe ranges
// host-local would accept.
func FuzzNetConf(f *testing.F) {
	for _, seed := range []struct{ conf, args string }{
		{`{"cniVersion":"1.0.0","name":"br1-net","type":"cnv-bridge","bridge":"br1"}`, ""},
		{`{"cniVersion":"0.3.1","name":"vlan100","type":"cnv-bridge","bridge":"br10","vlan":100,"macspoofchk":true,"preserveDefaultVlan":false}`, ""},
		{`{"cniVersion":"1.1.0","name":"trunk","plugins":[{"type":"cnv-bridge","bridge":"br0","vlanTrunk":[{"id":5},{"minID":10,"maxID":20}]},{"type":"tuning"}]}`, ""},
		{`{"cniVersion":"1.0.0","name":"gw","type":"bridge","isDefaultGateway":true,"ipMasq":true,"ipam":{"type":"host-local","ranges":[[{"subnet":"10.1.0.0/24","rangeStart":"10.1.0.10","rangeEnd":"10.1.0.20","gateway":"10.1.0.1"}],[{"subnet":"fd00::/64"}]],"routes":[{"dst":"0.0.0.0/0"}]}}`, ""},
		{`{"cniVersion":"1.0.0","name":"mac","type":"nodevirt-bridge","mtu":9000,"args":{"cni":{"mac":"02:00:00:00:00:01"}},"runtimeConfig":{"mac":"02:00:00:00:00:02"}}`, "IgnoreUnknown=1;MAC=02:00:00:00:00:03"},
		{`{"cniVersion":"1.0.0","name":"chk","type":"cnv-bridge","prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/run/netns/x"}],"ips":[{"address":"10.0.0.2/24","interface":0}]}}`, ""},
		{`{"cniVersion":"1.0.0","name":"bad","type":"cnv-bridge","vlan":5000}`, ""},
		{`{"plugins":[]}`, ""},
	} {
		f.Add([]byte(seed.conf), seed.args)
	}
	f.Fuzz(func(t *testing.T, conf []byte, envArgs string) {
		if n, err := LoadNetConf(conf, envArgs); err != nil {
			requireCNIError(t, err)
		} else {
			checkAccepted(t, conf, n)
		}
		n, err := ParseNetConf(conf)
		if err != nil {
			requireCNIError(t, err)
			return
		}
		if !isPluginType(n.Type) {
			t.Fatalf("ParseNetConf accepted type %q", n.Type)
		}
		if !has(conf, "plugins") {
			// A single plugin config: what the node agent reads from a
			// NetworkAttachmentDefinition is what the binary reads on stdin.
			direct, err := LoadNetConf(conf, "")
			if err != nil {
				t.Fatalf("ParseNetConf accepted what LoadNetConf refuses: %v", err)
			}
			if !reflect.DeepEqual(validated(direct), validated(n)) {
				t.Fatalf("the two parsers disagree:\n%+v\n%+v", validated(direct), validated(n))
			}
		} else {
			checkAccepted(t, nil, n)
		}
		checkHostLocal(t, conf)
	})
}

// validated is the validated part of a config.
func validated(n *NetConf) []any {
	return []any{n.Name, n.Type, n.CNIVersion, n.Bridge, n.MTU, n.VLAN, n.Trunk, n.StateDir, n.MAC.String(),
		n.PreserveDefaultVLAN, n.MACSpoofCheck, n.HairpinMode, n.PromiscMode, n.PortIsolation,
		n.IsGateway, n.IsDefaultGateway, n.IPMasq, n.IPAM.Type}
}

func requireCNIError(t *testing.T, err error) {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) || e.Code == 0 || e.Msg == "" {
		t.Fatalf("refusal %v (%T) is not a CNI error object", err, err)
	}
}

// has reports whether the top-level JSON object sets key to a non-null
// value (encoding/json matches keys case-insensitively).
func has(conf []byte, key string) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(conf, &m) != nil {
		return false
	}
	for k, v := range m {
		if strings.EqualFold(k, key) && string(v) != "null" {
			return true
		}
	}
	return false
}

// checkAccepted checks an accepted config's fields; conf, when given, is
// the JSON it came from, whose absent keys must have their defaults.
func checkAccepted(t *testing.T, conf []byte, n *NetConf) {
	t.Helper()
	if conf != nil {
		for _, d := range []struct {
			key     string
			applied bool
		}{
			{"bridge", n.Bridge == DefaultBridge},
			{"stateDir", n.StateDir == DefaultStateDir},
			{"preserveDefaultVlan", n.PreserveDefaultVLAN},
		} {
			if !has(conf, d.key) && !d.applied {
				t.Fatalf("%s default not applied: %+v", d.key, n)
			}
		}
	}
	if err := validIfName(n.Bridge); err != nil {
		t.Fatalf("accepted bridge %q: %v", n.Bridge, err)
	}
	if !strings.HasPrefix(n.StateDir, "/") {
		t.Fatalf("accepted relative stateDir %q", n.StateDir)
	}
	if n.MTU != 0 && (n.MTU < 68 || n.MTU > 65535) {
		t.Fatalf("accepted mtu %d", n.MTU)
	}
	if n.VLAN < 0 || n.VLAN > maxVLAN {
		t.Fatalf("accepted vlan %d", n.VLAN)
	}
	if len(n.Trunk) != len(n.VLANTrunk) {
		t.Fatalf("%d trunk entries validated into %d ranges", len(n.VLANTrunk), len(n.Trunk))
	}
	for _, r := range n.Trunk {
		if r.Min < 1 || r.Max > maxVLAN || r.Min > r.Max {
			t.Fatalf("accepted trunk range %+v", r)
		}
	}
	if n.HairpinMode && n.PromiscMode {
		t.Fatal("accepted hairpinMode with promiscMode")
	}
	if n.IsDefaultGateway && !n.IsGateway {
		t.Fatal("isDefaultGateway without isGateway")
	}
	if n.MAC != nil && (len(n.MAC) != 6 || n.MAC[0]&1 != 0) {
		t.Fatalf("accepted MAC %s", n.MAC)
	}
}

// checkHostLocal checks what the in-process host-local makes of an
// accepted config.
func checkHostLocal(t *testing.T, conf []byte) {
	t.Helper()
	h := nativeHostLocal(conf, "")
	if h == nil {
		return
	}
	if len(h.sets) == 0 || !strings.HasPrefix(h.dir, defaultIPAMDir) && !strings.Contains(string(conf), "dataDir") {
		t.Fatalf("host-local served with sets %v dir %q", h.sets, h.dir)
	}
	for _, set := range h.sets {
		if len(set) == 0 {
			t.Fatal("empty range set served")
		}
		for _, r := range set {
			if len(r.start) != len(r.end) || len(r.start) != len(r.subnet.IP) {
				t.Fatalf("range %+v mixes address lengths", r)
			}
			for _, ip := range []net.IP{r.start, r.end, r.gateway} {
				if !r.subnet.Contains(ip) {
					t.Fatalf("range %+v: %s outside the subnet", r, ip)
				}
			}
			if ipCompare(r.start, r.end) > 0 {
				t.Fatalf("range %+v starts after its end", r)
			}
		}
	}
}
