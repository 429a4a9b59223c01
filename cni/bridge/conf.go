// Package bridge attaches network endpoints to a Linux bridge: veth pairs
// into container network namespaces (the CNI plugin `cnv-bridge`, also
// installed as `nodevirt-bridge`) and persistent tap devices for VM NICs (the
// nodeagent calls AttachTap in-process). Both paths share the bridge, port,
// VLAN and MAC spoof-check code, and both record what they made in a state
// directory so that removal works even when the network namespace is gone.
package bridge

import (
	"encoding/json"
	"fmt"
	"net"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
)

const (
	// DefaultBridge is the bridge used when the config names none.
	DefaultBridge = "cni0"
	// DefaultStateDir holds per-attachment records and the bridge locks.
	DefaultStateDir = "/var/lib/cni/nodevirt-bridge"

	// maxVLAN is the highest usable 802.1Q VLAN ID.
	maxVLAN = 4094
)

// PluginTypes are the "type" values this package accepts.
var PluginTypes = []string{"cnv-bridge", "nodevirt-bridge", "bridge"}

// TrunkRange is one entry of vlanTrunk: either a single ID or a range.
type TrunkRange struct {
	ID    *int `json:"id,omitempty"`
	MinID *int `json:"minID,omitempty"`
	MaxID *int `json:"maxID,omitempty"`
}

// VLANRange is a validated inclusive range of VLAN IDs.
type VLANRange struct {
	Min int `json:"min"`
	Max int `json:"max"`
}

// NetConf is the plugin configuration: the options of the reference bridge
// plugin, which NetworkAttachmentDefinitions written for OpenShift
// Virtualization's cnv-bridge use, plus stateDir.
type NetConf struct {
	types.PluginConf

	Bridge                    string       `json:"bridge"`
	MTU                       int          `json:"mtu"`
	VLAN                      int          `json:"vlan"`
	VLANTrunk                 []TrunkRange `json:"vlanTrunk,omitempty"`
	PreserveDefaultVLAN       bool         `json:"preserveDefaultVlan"`
	MACSpoofCheck             bool         `json:"macspoofchk"`
	HairpinMode               bool         `json:"hairpinMode"`
	PromiscMode               bool         `json:"promiscMode"`
	PortIsolation             bool         `json:"portIsolation"`
	DisableContainerInterface bool         `json:"disableContainerInterface"`
	EnableDAD                 bool         `json:"enabledad"`
	IsGateway                 bool         `json:"isGateway"`
	IsDefaultGateway          bool         `json:"isDefaultGateway"`
	ForceAddress              bool         `json:"forceAddress"`
	IPMasq                    bool         `json:"ipMasq"`

	Args struct {
		CNI struct {
			MAC string `json:"mac,omitempty"`
		} `json:"cni"`
	} `json:"args"`
	RuntimeConfig struct {
		MAC string `json:"mac,omitempty"`
	} `json:"runtimeConfig"`

	// StateDir overrides DefaultStateDir (tests point it at a temp dir).
	StateDir string `json:"stateDir,omitempty"`

	// MAC is the requested container/tap MAC, resolved from CNI_ARGS,
	// args.cni.mac and runtimeConfig.mac (later ones win). Nil: kernel picks.
	MAC net.HardwareAddr `json:"-"`
	// Trunk is VLANTrunk validated into ranges.
	Trunk []VLANRange `json:"-"`
}

// macEnvArgs is the CNI_ARGS shape carrying a MAC.
type macEnvArgs struct {
	types.CommonArgs
	MAC types.UnmarshallableString `json:"mac,omitempty"`
}

// ConfigError builds the CNI error object for an invalid config field.
func ConfigError(field string, format string, a ...any) *types.Error {
	return types.NewError(types.ErrInvalidNetworkConfig,
		fmt.Sprintf("invalid %q: %s", field, fmt.Sprintf(format, a...)), "")
}

// defaultNetConf is the config before the user's JSON is applied.
func defaultNetConf() *NetConf {
	return &NetConf{
		Bridge:              DefaultBridge,
		PreserveDefaultVLAN: true,
		StateDir:            DefaultStateDir,
	}
}

// LoadNetConf parses a plugin's stdin config and its CNI_ARGS, sets
// defaults first and validates right after. Errors are CNI error objects.
func LoadNetConf(stdin []byte, envArgs string) (*NetConf, error) {
	n := defaultNetConf()
	if err := json.Unmarshal(stdin, n); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("decode network config: %v", err), "")
	}
	if envArgs != "" {
		var e macEnvArgs
		e.IgnoreUnknown = true
		if err := types.LoadArgs(envArgs, &e); err != nil {
			return nil, types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("CNI_ARGS: %v", err), "")
		}
		if e.MAC != "" {
			if err := n.setMAC("CNI_ARGS MAC", string(e.MAC)); err != nil {
				return nil, err
			}
		}
	}
	if n.Args.CNI.MAC != "" {
		if err := n.setMAC("args.cni.mac", n.Args.CNI.MAC); err != nil {
			return nil, err
		}
	}
	if n.RuntimeConfig.MAC != "" {
		if err := n.setMAC("runtimeConfig.mac", n.RuntimeConfig.MAC); err != nil {
			return nil, err
		}
	}
	if err := n.validate(); err != nil {
		return nil, err
	}
	if err := version.ParsePrevResult(&n.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("prevResult: %v", err), "")
	}
	return n, nil
}

// ParseNetConf accepts what a NetworkAttachmentDefinition's spec.config
// holds: a single plugin config or a conflist whose plugins[0] is this
// plugin (types cnv-bridge, nodevirt-bridge or bridge). cniVersion and name
// of a conflist are carried into the plugin config.
func ParseNetConf(config []byte) (*NetConf, error) {
	var list struct {
		CNIVersion string            `json:"cniVersion"`
		Name       string            `json:"name"`
		Plugins    []json.RawMessage `json:"plugins"`
	}
	if err := json.Unmarshal(config, &list); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("decode network config: %v", err), "")
	}
	raw := config
	if list.Plugins != nil {
		if len(list.Plugins) == 0 {
			return nil, ConfigError("plugins", "empty list")
		}
		var m map[string]any
		if err := json.Unmarshal(list.Plugins[0], &m); err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("decode plugins[0]: %v", err), "")
		}
		if m == nil {
			return nil, ConfigError("plugins[0]", "is null, not a plugin config")
		}
		if _, ok := m["cniVersion"]; !ok && list.CNIVersion != "" {
			m["cniVersion"] = list.CNIVersion
		}
		if _, ok := m["name"]; !ok && list.Name != "" {
			m["name"] = list.Name
		}
		b, err := json.Marshal(m)
		if err != nil {
			return nil, fmt.Errorf("re-encode plugins[0]: %w", err)
		}
		raw = b
	}
	n, err := LoadNetConf(raw, "")
	if err != nil {
		return nil, err
	}
	if !isPluginType(n.Type) {
		return nil, ConfigError("type", "%q is not one of %s", n.Type, strings.Join(PluginTypes, ", "))
	}
	return n, nil
}

func isPluginType(t string) bool {
	for _, p := range PluginTypes {
		if t == p {
			return true
		}
	}
	return false
}

func (n *NetConf) setMAC(field, s string) error {
	mac, err := net.ParseMAC(s)
	if err != nil || len(mac) != 6 {
		return ConfigError(field, "%q is not an Ethernet MAC address", s)
	}
	if mac[0]&1 == 1 {
		return ConfigError(field, "%q is a multicast address", s)
	}
	n.MAC = mac
	return nil
}

func (n *NetConf) validate() error {
	if err := validIfName(n.Bridge); err != nil {
		return ConfigError("bridge", "%q: %v", n.Bridge, err)
	}
	if n.MTU != 0 && (n.MTU < 68 || n.MTU > 65535) {
		return ConfigError("mtu", "%d is outside 68..65535", n.MTU)
	}
	if n.VLAN < 0 || n.VLAN > maxVLAN {
		return ConfigError("vlan", "%d is outside 0..%d", n.VLAN, maxVLAN)
	}
	n.Trunk = nil
	for i, t := range n.VLANTrunk {
		field := fmt.Sprintf("vlanTrunk[%d]", i)
		var r VLANRange
		switch {
		case t.ID != nil && (t.MinID != nil || t.MaxID != nil):
			return ConfigError(field, "set either id or minID/maxID, not both")
		case t.ID != nil:
			r = VLANRange{Min: *t.ID, Max: *t.ID}
		case t.MinID != nil && t.MaxID != nil:
			r = VLANRange{Min: *t.MinID, Max: *t.MaxID}
		default:
			return ConfigError(field, "needs id, or both minID and maxID")
		}
		if r.Min < 1 || r.Max > maxVLAN || r.Min > r.Max {
			return ConfigError(field, "range %d..%d is not within 1..%d in order", r.Min, r.Max, maxVLAN)
		}
		n.Trunk = append(n.Trunk, r)
	}
	if n.HairpinMode && n.PromiscMode {
		return ConfigError("hairpinMode", "cannot be combined with promiscMode")
	}
	if n.IsDefaultGateway {
		n.IsGateway = true
	}
	if n.IsGateway && n.VLAN != 0 && n.IPAM.Type != "" {
		return types.NewError(types.ErrUnsupportedField,
			fmt.Sprintf("isGateway=true with vlan=%d is not supported by this plugin", n.VLAN), "")
	}
	if n.StateDir == "" || !strings.HasPrefix(n.StateDir, "/") {
		return ConfigError("stateDir", "%q is not an absolute path", n.StateDir)
	}
	return nil
}

// wantsVLANFiltering reports whether this attachment needs the bridge to
// filter VLANs (a tag or trunk, or removing the default VLAN).
func (n *NetConf) wantsVLANFiltering() bool {
	return n.VLAN != 0 || len(n.Trunk) > 0
}

// validIfName checks a Linux interface name.
func validIfName(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("empty")
	case len(s) > 15:
		return fmt.Errorf("longer than 15 bytes")
	case s == "." || s == "..":
		return fmt.Errorf("reserved name")
	case strings.ContainsAny(s, "/: \t\n"):
		return fmt.Errorf("contains '/', ':' or whitespace")
	}
	return nil
}
