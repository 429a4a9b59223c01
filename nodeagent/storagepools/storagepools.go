// Package storagepools is the node agent's part of the HostPathProvisioner
// (hostpath-provisioner-operator's pool worker): it reads every
// HostPathProvisioner, opens the pools whose workload placement selects this
// node in the node's CSI driver, closes the ones no longer defined (once
// empty), and reports each pool's state on its Node (the contract is
// clusterbrain/api/poolstate).
//
// The pools of the agent's --pools flag are always served and win over a
// HostPathProvisioner pool of the same name: the standalone and systemd
// override. Pools taken from HostPathProvisioners are remembered in a state
// file, so a restarted agent serves their volumes before it has read the API.
package storagepools

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/poolstate"
	"github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// Driver is the node's CSI driver as far as pools go. Without it the node
// serves no volumes at all, so it is required.
type Driver interface {
	AddPool(csi.PoolConfig) error
	RemovePool(name string) error
	PoolPath(name string) (string, bool)
}

var _ Driver = (*csi.Driver)(nil)

// Config configures the role.
type Config struct {
	NodeName string
	Kube     kube.Interface
	// HPPs reads the HostPathProvisioners.
	HPPs   client.Resource[*hppv1beta1.HostPathProvisioner]
	Driver Driver
	// FlagPools are the --pools pools (name → directory), served already
	// by Driver.
	FlagPools map[string]string
	// StateFile remembers the pools taken from HostPathProvisioners.
	StateFile string
	// Resync is how often everything is checked again (30 s when zero).
	Resync time.Duration
	Log    *slog.Logger
}

// Pools is the role.
type Pools struct {
	cfg Config
	log *slog.Logger
	// added are the pools opened from HostPathProvisioners (name →
	// directory); only the sync loop touches it.
	added map[string]string
	// written is the state file's content as last written.
	written string
	kick    chan struct{}
}

// New validates cfg and opens the pools an earlier run took from
// HostPathProvisioners, so their volumes are served from the start.
func New(cfg Config) (*Pools, error) {
	if cfg.NodeName == "" || cfg.Kube == nil || cfg.Driver == nil || cfg.StateFile == "" {
		return nil, errors.New("storagepools: node name, kube client, driver and state file are required")
	}
	if cfg.Resync == 0 {
		cfg.Resync = 30 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	p := &Pools{cfg: cfg, log: cfg.Log.With("node", cfg.NodeName), added: map[string]string{}, kick: make(chan struct{}, 1)}
	remembered, err := p.readState()
	if err != nil {
		p.log.Warn("storage pools: state file unreadable, starting without it", "file", cfg.StateFile, "err", err)
	}
	for name, dir := range remembered {
		if _, flag := cfg.FlagPools[name]; flag {
			continue
		}
		if err := cfg.Driver.AddPool(csi.PoolConfig{Name: name, Path: dir}); err != nil {
			p.log.Warn("storage pools: remembered pool not opened", "pool", name, "path", dir, "err", err)
			continue
		}
		p.added[name] = dir
	}
	return p, nil
}

// Name implements daemon.Role.
func (p *Pools) Name() string { return "storage-pools" }

// Run keeps the pools in line with the HostPathProvisioners until ctx ends.
func (p *Pools) Run(ctx context.Context) error {
	hpps := p.cfg.HPPs.Informer("", 0, nil)
	nodes := cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", p.cfg.NodeName).String()
			return p.cfg.Kube.CoreV1().Nodes().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", p.cfg.NodeName).String()
			return p.cfg.Kube.CoreV1().Nodes().Watch(ctx, o)
		},
	}, &corev1.Node{}, 0, cache.Indexers{})
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { p.trigger() },
		UpdateFunc: func(_, _ any) { p.trigger() },
		DeleteFunc: func(any) { p.trigger() },
	}
	if _, err := hpps.AddEventHandler(handler); err != nil {
		return err
	}
	// The Node changes at every heartbeat; only its labels and taints
	// decide which pools it serves (the resync restores the report).
	if _, err := nodes.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { p.trigger() },
		UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*corev1.Node)
			n, ok2 := cur.(*corev1.Node)
			if !ok1 || !ok2 || !maps.Equal(o.Labels, n.Labels) || !equality.Semantic.DeepEqual(o.Spec.Taints, n.Spec.Taints) {
				p.trigger()
			}
		},
	}); err != nil {
		return err
	}
	go hpps.RunWithContext(ctx)
	go nodes.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), hpps.HasSynced, nodes.HasSynced) {
		return nil
	}
	tick := time.NewTicker(p.cfg.Resync)
	defer tick.Stop()
	for {
		var list []*hppv1beta1.HostPathProvisioner
		for _, o := range hpps.GetStore().List() {
			list = append(list, o.(*hppv1beta1.HostPathProvisioner))
		}
		node, _, _ := nodes.GetStore().GetByKey(p.cfg.NodeName)
		if n, ok := node.(*corev1.Node); ok {
			if err := p.Sync(ctx, n, list); err != nil {
				p.log.Warn("storage pools", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-p.kick:
		case <-tick.C:
		}
	}
}

func (p *Pools) trigger() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Sync opens and closes pools for node's view of hpps and writes the
// result on the Node. It is the role's whole logic, called by Run.
func (p *Pools) Sync(ctx context.Context, node *corev1.Node, hpps []*hppv1beta1.HostPathProvisioner) error {
	states := p.apply(node, hpps)
	if err := p.writeState(); err != nil {
		p.log.Warn("storage pools: state file not written", "file", p.cfg.StateFile, "err", err)
	}
	value := poolstate.Encode(poolstate.NodePools{Pools: states})
	if node.Annotations[poolstate.AnnotationNodePools] == value {
		return nil
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{poolstate.AnnotationNodePools: value}}})
	if _, err := p.cfg.Kube.CoreV1().Nodes().Patch(ctx, p.cfg.NodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("report pools on node %s: %w", p.cfg.NodeName, err)
	}
	return nil
}

// apply opens what hpps ask of this node and closes what they no longer
// ask, returning every pool's state.
func (p *Pools) apply(node *corev1.Node, hpps []*hppv1beta1.HostPathProvisioner) []poolstate.PoolState {
	sort.Slice(hpps, func(i, j int) bool { return hpps[i].Name < hpps[j].Name })
	var states []poolstate.PoolState
	taken := map[string]string{} // pool name → HostPathProvisioner
	for name, dir := range p.cfg.FlagPools {
		path, _ := p.cfg.Driver.PoolPath(name)
		if path == "" {
			path = dir
		}
		states = append(states, poolstate.PoolState{Name: name, Path: path, Phase: poolstate.PhaseReady})
	}
	for _, hpp := range hpps {
		if hpp.DeletionTimestamp != nil {
			continue
		}
		if why := poolstate.Select(hpp, node); why != "" {
			p.log.Debug("storage pools: not selected", "hostpathprovisioner", hpp.Name, "why", why)
			continue
		}
		for _, w := range poolstate.Pools(hpp) {
			st := poolstate.PoolState{Name: w.Name, Path: w.Dir, Provisioner: hpp.Name, Phase: poolstate.PhaseReady}
			_, flag := p.cfg.FlagPools[w.Name]
			switch {
			case taken[w.Name] != "":
				st.Path, st.Phase = "", poolstate.PhaseRefused
				st.Message = fmt.Sprintf("pool %s is defined by HostPathProvisioner %s too", w.Name, taken[w.Name])
			case w.Refused != "":
				st.Phase, st.Message = poolstate.PhaseRefused, w.Refused
			case flag:
				// The node's --pools wins: its directory serves the pool.
				st.Path, _ = p.cfg.Driver.PoolPath(w.Name)
				st.Message = "served from the node agent's --pools at " + st.Path
			default:
				if err := p.cfg.Driver.AddPool(csi.PoolConfig{Name: w.Name, Path: w.Dir}); err != nil {
					st.Phase, st.Message = poolstate.PhaseFailed, err.Error()
					break
				}
				p.added[w.Name] = w.Dir
			}
			if taken[w.Name] == "" {
				taken[w.Name] = hpp.Name
			}
			if flag {
				// The flag pool's own entry gives way to this one.
				states = dropState(states, w.Name)
			}
			states = append(states, st)
		}
	}
	for name, dir := range p.added {
		if _, wanted := taken[name]; wanted && p.cfg.FlagPools[name] == "" {
			if s, ok := findState(states, name); ok && s.Phase == poolstate.PhaseReady && s.Path == dir {
				continue
			}
		}
		err := p.cfg.Driver.RemovePool(name)
		switch {
		case err == nil:
			delete(p.added, name)
			p.log.Info("storage pools: pool closed", "pool", name, "path", dir)
		case errors.Is(err, csi.ErrPoolInUse):
			if _, listed := findState(states, name); !listed {
				states = append(states, poolstate.PoolState{Name: name, Path: dir, Phase: poolstate.PhaseReady,
					Message: "no longer defined by a HostPathProvisioner for this node; kept while it holds volumes (" + err.Error() + ")"})
			}
		default:
			p.log.Warn("storage pools: pool not closed", "pool", name, "err", err)
		}
	}
	return states
}

func findState(states []poolstate.PoolState, name string) (poolstate.PoolState, bool) {
	for _, s := range states {
		if s.Name == name {
			return s, true
		}
	}
	return poolstate.PoolState{}, false
}

func dropState(states []poolstate.PoolState, name string) []poolstate.PoolState {
	out := states[:0]
	for _, s := range states {
		if s.Name != name || s.Provisioner != "" {
			out = append(out, s)
		}
	}
	return out
}

func (p *Pools) readState() (map[string]string, error) {
	b, err := os.ReadFile(p.cfg.StateFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var m map[string]string
	return m, json.Unmarshal(b, &m)
}

func (p *Pools) writeState() error {
	b, _ := json.Marshal(p.added)
	if string(b) == p.written {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(p.cfg.StateFile), 0o755); err != nil {
		return err
	}
	tmp := p.cfg.StateFile + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, p.cfg.StateFile); err != nil {
		return err
	}
	p.written = string(b)
	return nil
}
