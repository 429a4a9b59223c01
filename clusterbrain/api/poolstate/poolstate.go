// Package poolstate is the contract between the node agents and the brain
// about the storage pools a HostPathProvisioner (hostpathprovisioner.kubevirt.io)
// defines: which nodes serve which pools, in which directory, and what
// each node reports back.
//
// Who owns what:
//
//   - The user (or the HCO, from spec.storagePools) owns the
//     HostPathProvisioner's spec.
//   - Every node agent reads the HostPathProvisioners, computes with Select
//     and Pools which pools it must serve, opens them in its CSI driver
//     (beside the pools of its --pools flag, which win on a name clash) and
//     writes what it serves, one PoolState per pool, as JSON in the
//     annotation AnnotationNodePools of its own Node. Nobody else writes
//     that annotation.
//   - The brain owns the HostPathProvisioner's status: from the Nodes'
//     annotations it counts, per pool, the nodes that should serve it
//     (DesiredReady: ready node agents Select picks) and those that do
//     (CurrentReady), and it keeps one StorageClass per pool.
//
// A pool the node cannot serve (a pvcTemplate, an invalid name or path, a
// directory that cannot be made) is listed with PhaseRefused or PhaseFailed
// and a message, so the brain can name the node and the cause.
package poolstate

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"regexp"
	"sort"

	corev1 "k8s.io/api/core/v1"

	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
)

// AnnotationNodePools is the Node annotation a node agent writes: the
// JSON of NodePools.
const AnnotationNodePools = "hostpathprovisioner.kubevirt.io/storage-pools"

// LegacyPoolName is the pool spec.pathConfig defines (upstream's name).
const LegacyPoolName = "legacy"

// Upstream's limits on a pool's name and path.
const (
	maxNameLength = 50
	maxPathLength = 255
)

// Phase is a pool's state on one node.
type Phase string

// Phases a node reports.
const (
	// PhaseReady: the pool's directory is open in the node's CSI driver.
	PhaseReady Phase = "Ready"
	// PhaseFailed: the node tried and could not open it (the message says
	// why); it tries again.
	PhaseFailed Phase = "Failed"
	// PhaseRefused: the pool's definition cannot be served by nodevirt
	// (the message names the field).
	PhaseRefused Phase = "Refused"
)

// PoolState is one pool as a node serves it.
type PoolState struct {
	Name string `json:"name"`
	// Path is the directory the node's volumes of this pool live in.
	Path string `json:"path,omitempty"`
	// Provisioner names the HostPathProvisioner that defines the pool;
	// empty for a pool of the node's --pools flag.
	Provisioner string `json:"provisioner,omitempty"`
	Phase       Phase  `json:"phase"`
	Message     string `json:"message,omitempty"`
}

// NodePools is the annotation's content.
type NodePools struct {
	Pools []PoolState `json:"pools"`
}

// Encode returns the annotation value for p, pools sorted by name.
func Encode(p NodePools) string {
	sort.Slice(p.Pools, func(i, j int) bool { return p.Pools[i].Name < p.Pools[j].Name })
	b, err := json.Marshal(p)
	if err != nil {
		panic(err) // plain strings always marshal
	}
	return string(b)
}

// Decode reads a Node's annotation; a missing one is an empty NodePools.
func Decode(node *corev1.Node) (NodePools, error) {
	var p NodePools
	v, ok := node.Annotations[AnnotationNodePools]
	if !ok {
		return p, nil
	}
	if err := json.Unmarshal([]byte(v), &p); err != nil {
		return p, fmt.Errorf("node %s: annotation %s: %w", node.Name, AnnotationNodePools, err)
	}
	return p, nil
}

// Find returns the named pool's state, if the node lists it.
func (p NodePools) Find(name string) (PoolState, bool) {
	for _, s := range p.Pools {
		if s.Name == name {
			return s, true
		}
	}
	return PoolState{}, false
}

// For returns the named pool's state as the node serves it for the named
// HostPathProvisioner.
func (p NodePools) For(name, provisioner string) (PoolState, bool) {
	for _, s := range p.Pools {
		if s.Name == name && s.Provisioner == provisioner {
			return s, true
		}
	}
	return PoolState{}, false
}

// Wanted is one pool a HostPathProvisioner defines.
type Wanted struct {
	Name string
	// Dir is where its volumes live on every node.
	Dir string
	// Refused, when set, says why the pool cannot be served.
	Refused string
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// Pools lists the pools hpp defines, in spec order: spec.pathConfig is the
// pool "legacy" in its path; each of spec.storagePools is served in
// <path>/csi. A spec that breaks upstream's rules (both or neither of
// pathConfig and storagePools, blank or too long names and paths,
// duplicates) refuses the pools it concerns with upstream's message.
func Pools(hpp *hppv1beta1.HostPathProvisioner) []Wanted {
	s := hpp.Spec
	switch {
	case s.PathConfig != nil && len(s.StoragePools) > 0:
		out := []Wanted{{Name: LegacyPoolName, Refused: "pathConfig and storage pools cannot be both set"}}
		for _, p := range s.StoragePools {
			out = append(out, Wanted{Name: p.Name, Refused: "pathConfig and storage pools cannot be both set"})
		}
		return out
	case s.PathConfig != nil:
		w := Wanted{Name: LegacyPoolName, Dir: filepath.Clean(s.PathConfig.Path)}
		if why := checkPath(s.PathConfig.Path, "spec.pathConfig.path"); why != "" {
			w.Dir, w.Refused = "", why
		}
		return []Wanted{w}
	}
	var out []Wanted
	names, paths := map[string]int{}, map[string]int{}
	for i, p := range s.StoragePools {
		w := Wanted{Name: p.Name}
		field := fmt.Sprintf("spec.storagePools[%d]", i)
		switch {
		case p.Name == "":
			w.Name, w.Refused = fmt.Sprintf("#%d", i), "storagePool.name cannot be blank"
		case len(p.Name) > maxNameLength:
			w.Refused = fmt.Sprintf("storagePool.name cannot have a length greater than %d", maxNameLength)
		case !nameRE.MatchString(p.Name):
			w.Refused = field + ".name: only letters, digits, '-', '_' and '.' (nodevirt names volumes' directories after it)"
		case checkPath(p.Path, field+".path") != "":
			w.Refused = checkPath(p.Path, field+".path")
		case p.PVCTemplate != nil:
			w.Refused = field + ".pvcTemplate: pools backed by a claim of another StorageClass are not supported by nodevirt; use a host directory"
		}
		if j, dup := names[p.Name]; dup && w.Refused == "" {
			w.Refused = fmt.Sprintf("spec.storagePools[%d].name is the same as spec.storagePools[%d].name, cannot have duplicate names", i, j)
		}
		if j, dup := paths[filepath.Clean(p.Path)]; dup && w.Refused == "" {
			w.Refused = fmt.Sprintf("spec.storagePools[%d].path is the same as spec.storagePools[%d].path, cannot have duplicate paths", i, j)
		}
		if _, seen := names[p.Name]; !seen {
			names[p.Name] = i
		}
		if _, seen := paths[filepath.Clean(p.Path)]; !seen && p.Path != "" {
			paths[filepath.Clean(p.Path)] = i
		}
		if w.Refused == "" {
			w.Dir = filepath.Join(filepath.Clean(p.Path), "csi")
		}
		out = append(out, w)
	}
	if len(out) == 0 {
		return []Wanted{{Name: LegacyPoolName, Refused: "either pathConfig or storage pools must be set"}}
	}
	return out
}

func checkPath(p, field string) string {
	switch {
	case p == "":
		return field + " cannot be blank"
	case len(p) > maxPathLength:
		return fmt.Sprintf("%s cannot have a length greater than %d", field, maxPathLength)
	case !filepath.IsAbs(p):
		return field + " must be an absolute path"
	case filepath.Clean(p) == "/":
		return field + " cannot be the root directory"
	}
	return ""
}

// Select reports whether hpp's spec.workload places its pools on node:
// the node selector and required node affinity match the node's labels,
// and every NoSchedule/NoExecute taint is tolerated (the node.kubernetes.io/
// condition taints excepted, as for a DaemonSet's pods). The empty string
// means yes; otherwise it says why not.
func Select(hpp *hppv1beta1.HostPathProvisioner, node *corev1.Node) string {
	w := hpp.Spec.Workload
	return nodeplacement.Admits(nodeplacement.Placement{NodeSelector: w.NodeSelector, Affinity: w.Affinity,
		Tolerations: w.Tolerations, Field: "spec.workload", DaemonLike: true}, node)
}
