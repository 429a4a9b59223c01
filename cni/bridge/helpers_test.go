package bridge_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/vishvananda/netlink"

	"github.com/nodevirt/nodevirt/cni/cnitest"
)

// pluginDir holds the plugin binary, built on first use (fuzz workers and
// pure-logic tests never build it) and removed by TestMain.
var (
	pluginBinDir string
	buildPlugin  = sync.OnceValues(func() (string, error) {
		if os.Geteuid() != 0 {
			return "", errors.New("bridge tests need root (network namespaces)")
		}
		dir, err := os.MkdirTemp("", "cnv-bridge-bin-")
		if err != nil {
			return "", err
		}
		pluginBinDir = dir
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		return cnitest.BuildPlugin(ctx, dir)
	})
)

func pluginDir(t *testing.T) string {
	t.Helper()
	dir, err := buildPlugin()
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if pluginBinDir != "" {
		os.RemoveAll(pluginBinDir)
	}
	os.Exit(code)
}

// env is one throwaway "host" namespace with its own state, IPAM data and
// libcni cache directories.
type env struct {
	t        *testing.T
	host     *cnitest.NS
	rt       *cnitest.Runtime
	stateDir string
	ipamDir  string
	cacheDir string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	host, err := cnitest.NewNS("nvb-host")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = host.Close() })
	base := t.TempDir()
	e := &env{
		t: t, host: host,
		stateDir: filepath.Join(base, "state"),
		ipamDir:  filepath.Join(base, "ipam"),
		cacheDir: filepath.Join(base, "cache"),
	}
	e.rt = cnitest.NewRuntime(host, []string{pluginDir(t)}, e.cacheDir)
	return e
}

func (e *env) container() *cnitest.NS {
	e.t.Helper()
	c, err := cnitest.NewNS("nvb-ctr")
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = c.Close() })
	return c
}

// conf renders a plugin config: the base fields plus extra (which may
// override them). ipam "host-local" on subnet is added when subnet != "".
func (e *env) conf(version, subnet string, extra map[string]any) []byte {
	m := map[string]any{
		"cniVersion": version,
		"name":       "testnet",
		"type":       "cnv-bridge",
		"bridge":     "br0",
		"stateDir":   e.stateDir,
	}
	if subnet != "" {
		m["ipam"] = map[string]any{"type": "host-local", "subnet": subnet, "dataDir": e.ipamDir}
	}
	for k, v := range extra {
		if v == nil {
			delete(m, k)
			continue
		}
		m[k] = v
	}
	b, err := json.Marshal(m)
	if err != nil {
		e.t.Fatal(err)
	}
	return b
}

// hostLinks returns the names of the host namespace's links, by kind.
func (e *env) hostLinks() map[string]string {
	e.t.Helper()
	out := map[string]string{}
	err := e.host.Do(func() error {
		ls, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range ls {
			out[l.Attrs().Name] = l.Type()
		}
		return nil
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

// ports lists the links enslaved to bridge in the host namespace.
func (e *env) ports(bridge string) []string {
	e.t.Helper()
	var out []string
	err := e.host.Do(func() error {
		br, err := netlink.LinkByName(bridge)
		if err != nil {
			return err
		}
		ls, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range ls {
			if l.Attrs().MasterIndex == br.Attrs().Index {
				out = append(out, l.Attrs().Name)
			}
		}
		return nil
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

// ruleset is the host namespace's nft ruleset.
func (e *env) ruleset() string {
	e.t.Helper()
	out, err := e.host.Run(context.Background(), "nft", "list", "ruleset")
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

// stateFiles lists files under the state directory's attachment records.
func (e *env) stateFiles() []string {
	var out []string
	_ = filepath.Walk(filepath.Join(e.stateDir), func(p string, info os.FileInfo, err error) error {
		if err == nil && !info.IsDir() && strings.HasSuffix(p, ".json") {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// reservations lists host-local's reserved addresses for testnet.
func (e *env) reservations() []string {
	ents, _ := os.ReadDir(filepath.Join(e.ipamDir, "testnet"))
	var out []string
	for _, en := range ents {
		if n := en.Name(); n != "lock" && !strings.HasPrefix(n, "last_reserved_ip") {
			out = append(out, n)
		}
	}
	return out
}

func att(id string, c *cnitest.NS) *libcni.RuntimeConf {
	return cnitest.Attachment(id, c, "eth0")
}

// cniError returns the CNI error object in err, failing the test if none.
func cniError(t *testing.T, err error) *types.Error {
	t.Helper()
	if err == nil {
		t.Fatal("expected an error, got success")
	}
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %T %v is not a CNI error object", err, err)
	}
	return e
}

// vlanFilteringWorks probes the running kernel for bridge VLAN filtering by
// creating a filtering bridge in a throwaway namespace.
func vlanFilteringWorks(t *testing.T) bool {
	t.Helper()
	ns, err := cnitest.NewNS("nvb-probe")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	on := true
	err = ns.Do(func() error {
		return netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "probe0"}, VlanFiltering: &on})
	})
	return err == nil
}
