package bridge

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
)

// ipam delegates address management to the plugin named in ipam.type, found
// on CNI_PATH. An IPAM plugin older than the config's cniVersion (Debian's
// host-local speaks up to 1.0.0) is called at the highest version it
// supports, so a 1.1.0 network still gets addresses.
type ipam struct {
	typ  string
	path string

	// native, when set, serves host-local in-process for one attachment.
	native           *hostLocal
	containerID, ifc string
}

// serveNative lets host-local configs it can serve bypass the binary.
func (p *ipam) serveNative(stdin []byte, envArgs, containerID, ifName string) {
	if p.typ == hostLocalType {
		p.native = nativeHostLocal(stdin, envArgs)
		p.containerID, p.ifc = containerID, ifName
	}
}

func newIPAM(typ string) (*ipam, error) {
	p, err := invoke.FindInPath(typ, filepath.SplitList(os.Getenv("CNI_PATH")))
	if err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf("invalid \"ipam.type\": %v", err), "")
	}
	return &ipam{typ: typ, path: p}, nil
}

func isIncompatible(err error) bool {
	var e *types.Error
	return errors.As(err, &e) && e.Code == types.ErrIncompatibleCNIVersion
}

// downgrade rewrites stdin to the highest cniVersion the plugin supports that
// is not newer than the config's, converting prevResult along. ok is false
// when the plugin supports nothing usable.
func (p *ipam) downgrade(ctx context.Context, stdin []byte, n *NetConf) ([]byte, bool, error) {
	info, err := invoke.GetVersionInfo(ctx, p.path, nil)
	if err != nil {
		return nil, false, fmt.Errorf("ipam %s version: %w", p.typ, err)
	}
	best := ""
	for _, v := range info.SupportedVersions() {
		if le, err := version.GreaterThanOrEqualTo(n.CNIVersion, v); err != nil || !le {
			continue
		}
		if best == "" {
			best = v
		} else if gt, _ := version.GreaterThan(v, best); gt {
			best = v
		}
	}
	if best == "" || best == n.CNIVersion {
		return nil, false, nil
	}
	var m map[string]any
	if err := json.Unmarshal(stdin, &m); err != nil {
		return nil, false, fmt.Errorf("re-decode config: %w", err)
	}
	m["cniVersion"] = best
	if n.PrevResult != nil {
		r, err := n.PrevResult.GetAsVersion(best)
		if err != nil {
			return nil, false, fmt.Errorf("convert prevResult to %s: %w", best, err)
		}
		m["prevResult"] = r
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, false, fmt.Errorf("re-encode config: %w", err)
	}
	return b, true, nil
}

// add allocates addresses; it returns them and the stdin the plugin took.
func (p *ipam) add(ctx context.Context, stdin []byte, n *NetConf) (*current.Result, []byte, error) {
	if p.native != nil {
		res, err := p.native.add(p.containerID, p.ifc)
		if err != nil {
			return nil, nil, fmt.Errorf("ipam %s add: %w", p.typ, err)
		}
		return res, stdin, nil
	}
	r, err := invoke.ExecPluginWithResult(ctx, p.path, stdin, &invoke.DelegateArgs{Command: "ADD"}, nil)
	if isIncompatible(err) {
		if b, ok, derr := p.downgrade(ctx, stdin, n); derr != nil {
			return nil, nil, derr
		} else if ok {
			stdin = b
			r, err = invoke.ExecPluginWithResult(ctx, p.path, stdin, &invoke.DelegateArgs{Command: "ADD"}, nil)
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("ipam %s add: %w", p.typ, err)
	}
	res, err := current.NewResultFromResult(r)
	if err != nil {
		return nil, nil, fmt.Errorf("ipam %s result: %w", p.typ, err)
	}
	if len(res.IPs) == 0 {
		return nil, nil, fmt.Errorf("ipam %s returned no IP configuration", p.typ)
	}
	return res, stdin, nil
}

// run calls a verb without result (DEL, CHECK) with the plugin's own
// environment args, downgrading the version when needed.
func (p *ipam) run(ctx context.Context, verb string, stdin []byte, n *NetConf, args invoke.CNIArgs) error {
	if p.native != nil && (verb == "DEL" || verb == "CHECK") {
		var err error
		if verb == "DEL" {
			err = p.native.release(p.containerID, p.ifc)
		} else {
			err = p.native.check(p.containerID, p.ifc)
		}
		if err != nil {
			return fmt.Errorf("ipam %s %s: %w", p.typ, verb, err)
		}
		return nil
	}
	if args == nil {
		args = &invoke.DelegateArgs{Command: verb}
	}
	err := invoke.ExecPluginWithoutResult(ctx, p.path, stdin, args, nil)
	if isIncompatible(err) && n != nil {
		if b, ok, derr := p.downgrade(ctx, stdin, n); derr != nil {
			return derr
		} else if ok {
			err = invoke.ExecPluginWithoutResult(ctx, p.path, b, args, nil)
		}
	}
	if err != nil {
		return fmt.Errorf("ipam %s %s: %w", p.typ, verb, err)
	}
	return nil
}

// speaks reports whether the plugin supports spec version v (STATUS and GC
// exist only from 1.1.0; an older plugin's skel rejects them).
func (p *ipam) speaks(ctx context.Context, v string) bool {
	info, err := invoke.GetVersionInfo(ctx, p.path, nil)
	if err != nil {
		return false
	}
	for _, s := range info.SupportedVersions() {
		if s == v {
			return true
		}
	}
	return false
}
