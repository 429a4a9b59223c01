package scheduler

import (
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
)

// Names the nodeagents and KubeVirt use on Nodes.
const (
	SchedulableLabel = "kubevirt.io/schedulable"
	BridgePrefix     = "bridge.network.kubevirt.io/"
	KVMResource      = corev1.ResourceName("devices.kubevirt.io/kvm")
	// KVMLabel is how nodevirt's nodeagents say a node has working KVM.
	KVMLabel         = "nodevirt.io/kvm"
	NADResourceName  = "k8s.v1.cni.cncf.io/resourceName"
	SelectedNodeAnno = "volume.kubernetes.io/selected-node"
)

// demand is what one VMI takes from a node.
type demand struct {
	cpu, mem int64 // millicores, bytes
	ext      map[corev1.ResourceName]int64
	kvm      bool
}

// demandOf computes a VMI's requests: memory from requests, else guest
// memory overcommitted by over (the request admission would have given it,
// for a VMI that has none: one created before the webhook was registered,
// or by a brain that did not yet apply it to replica sets' VMIs), else
// limits; CPU from requests, else 100m per vCPU (KubeVirt's default
// allocation ratio of 10); one unit of each NAD's resourceName per
// interface on it; one unit of a GPU's or host device's deviceName per
// device, the resource a device plugin advertises on the node (KubeVirt's
// launcher pod requests the same).
func demandOf(vmi *kubevirtv1.VirtualMachineInstance, over overcommit.Memory, nadResource func(ns, name string) (string, error)) (demand, error) {
	d := demand{ext: map[corev1.ResourceName]int64{}}
	dom := vmi.Spec.Domain
	switch {
	case !dom.Resources.Requests.Memory().IsZero():
		d.mem = dom.Resources.Requests.Memory().Value()
	case dom.Memory != nil && dom.Memory.Guest != nil:
		d.mem = over.Request(dom.Memory.Guest.Value())
	case !dom.Resources.Limits.Memory().IsZero():
		d.mem = dom.Resources.Limits.Memory().Value()
	}
	if q, ok := dom.Resources.Requests[corev1.ResourceCPU]; ok {
		d.cpu = q.MilliValue()
	} else {
		vcpus := int64(1)
		if c := dom.CPU; c != nil {
			vcpus = int64(max(c.Sockets, 1) * max(c.Cores, 1) * max(c.Threads, 1))
		}
		d.cpu = vcpus * 100
	}
	for _, g := range dom.Devices.GPUs {
		d.ext[corev1.ResourceName(g.DeviceName)]++
	}
	for _, h := range dom.Devices.HostDevices {
		d.ext[corev1.ResourceName(h.DeviceName)]++
	}
	for _, n := range vmi.Spec.Networks {
		if n.Multus == nil {
			continue
		}
		ns, name := vmi.Namespace, n.Multus.NetworkName
		if i := strings.Index(name, "/"); i >= 0 {
			ns, name = name[:i], name[i+1:]
		}
		res, err := nadResource(ns, name)
		if err != nil {
			return d, err
		}
		if res != "" {
			d.ext[corev1.ResourceName(res)]++
		}
	}
	return d, nil
}

// placed is a VMI that occupies a node (bound, or assumed while binding).
type placed struct {
	uid    types.UID
	ns     string
	labels labels.Set
	demand demand
	anti   []corev1.PodAffinityTerm // its required anti-affinity, checked symmetrically
}

// nodeState is a node with what is placed on it.
type nodeState struct {
	node   *corev1.Node
	placed []placed
	cpu    int64
	mem    int64
	ext    map[corev1.ResourceName]int64
	anti   int // placed VMIs with required anti-affinity
}

func newNodeState(n *corev1.Node) *nodeState {
	return &nodeState{node: n, ext: map[corev1.ResourceName]int64{}}
}

func (s *nodeState) add(p placed) {
	if len(p.anti) > 0 {
		s.anti++
	}
	s.placed = append(s.placed, p)
	s.cpu += p.demand.cpu
	s.mem += p.demand.mem
	for k, v := range p.demand.ext {
		s.ext[k] += v
	}
}

func alloc(n *corev1.Node, r corev1.ResourceName) (int64, bool) {
	q, ok := n.Status.Allocatable[r]
	if !ok {
		q, ok = n.Status.Capacity[r]
	}
	if !ok {
		return 0, false
	}
	if r == corev1.ResourceCPU {
		return q.MilliValue(), true
	}
	return q.Value(), true
}

// request is everything the placement of one VMI must satisfy.
type request struct {
	vmi     *kubevirtv1.VirtualMachineInstance
	demand  demand
	volumes []*corev1.NodeSelector // each must match (bound PVs, allowed topologies)
	// volumeOf names what holds each of volumes (a VMI volume and its
	// claim, a storage class), for the Unschedulable message: a VM whose
	// node-local volume sits on a lost node waits saying which volume.
	volumeOf  []string
	pinned    string // a PVC already selected this node
	pinnedBy  string // the volume that pinned it
	allowEmul bool
	// workloads is the KubeVirt CR's workloads placement (nil: none),
	// where virt-handler runs and so where VMIs may (workloads.go).
	workloads *nodeplacement.Placement
	// placedAnti: some placed VMI has required anti-affinity (else the
	// walk over placed VMIs is skipped for VMIs without affinity terms).
	placedAnti bool
}

// filter returns why node cannot take req (nil: it can). all is every
// node state, for inter-VMI affinity across topology domains.
func filter(req *request, st *nodeState, all []*nodeState) []string {
	n := st.node
	spec := &req.vmi.Spec
	if n.Labels[SchedulableLabel] != "true" || n.Spec.Unschedulable {
		return []string{"not schedulable"}
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status != corev1.ConditionTrue {
			return []string{"not ready"}
		}
	}
	if req.workloads != nil {
		if why := nodeplacement.Admits(*req.workloads, n); why != "" {
			return []string{why}
		}
	}
	for _, t := range n.Spec.Taints {
		if (t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute) && !tolerates(spec.Tolerations, t) {
			return []string{fmt.Sprintf("untolerated taint {%s: %s}", t.Key, t.Value)}
		}
	}
	for k, v := range spec.NodeSelector {
		if n.Labels[k] != v {
			return []string{"didn't match node selector"}
		}
	}
	if a := spec.Affinity; a != nil && a.NodeAffinity != nil && !matchNodeSelector(a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution, n) {
		return []string{"didn't match node affinity"}
	}
	var why []string
	if c, ok := alloc(n, corev1.ResourceCPU); !ok || st.cpu+req.demand.cpu > c {
		why = append(why, "insufficient cpu")
	}
	if m, ok := alloc(n, corev1.ResourceMemory); !ok || st.mem+req.demand.mem > m {
		why = append(why, "insufficient memory")
	}
	names := make([]string, 0, len(req.demand.ext))
	for r := range req.demand.ext {
		names = append(names, string(r))
	}
	sort.Strings(names)
	for _, r := range names {
		have, ok := alloc(n, corev1.ResourceName(r))
		label := r
		if strings.HasPrefix(r, BridgePrefix) {
			label = "bridge " + strings.TrimPrefix(r, BridgePrefix)
		}
		switch {
		case !ok || have == 0:
			why = append(why, "lacks "+label)
		case st.ext[corev1.ResourceName(r)]+req.demand.ext[corev1.ResourceName(r)] > have:
			why = append(why, "insufficient "+label)
		}
	}
	if !req.allowEmul {
		if k, _ := alloc(n, KVMResource); k == 0 && n.Labels[KVMLabel] != "true" {
			why = append(why, "lacks kvm")
		}
	}
	if len(why) > 0 {
		return why
	}
	if req.pinned != "" && req.pinned != n.Name {
		return []string{volumeConflict(req.pinnedBy)}
	}
	for i, sel := range req.volumes {
		if !matchNodeSelector(sel, n) {
			held := ""
			if i < len(req.volumeOf) {
				held = req.volumeOf[i]
			}
			return []string{volumeConflict(held)}
		}
	}
	if reason := interVMI(req, st, all); reason != "" {
		return []string{reason}
	}
	return nil
}

// sameDomain reports whether a and b share a value of key.
func sameDomain(a, b *corev1.Node, key string) bool {
	va, oka := a.Labels[key]
	vb, okb := b.Labels[key]
	return oka && okb && va == vb
}

func termMatches(t corev1.PodAffinityTerm, ownNS string, p placed) bool {
	nsOK := false
	switch {
	case len(t.Namespaces) > 0:
		for _, ns := range t.Namespaces {
			nsOK = nsOK || ns == p.ns
		}
	case t.NamespaceSelector != nil && len(t.NamespaceSelector.MatchLabels) == 0 && len(t.NamespaceSelector.MatchExpressions) == 0:
		nsOK = true // an empty namespace selector means every namespace
	default:
		nsOK = p.ns == ownNS
	}
	return nsOK && selectorOf(t.LabelSelector).Matches(p.labels)
}

// interVMI checks required VMI affinity and anti-affinity, including the
// anti-affinity of VMIs already placed (symmetry).
func interVMI(req *request, st *nodeState, all []*nodeState) string {
	vmi := req.vmi
	own := labels.Set(vmi.Labels)
	var aff *corev1.PodAffinity
	var anti *corev1.PodAntiAffinity
	if a := vmi.Spec.Affinity; a != nil {
		aff, anti = a.PodAffinity, a.PodAntiAffinity
	}
	if aff == nil && anti == nil && !req.placedAnti {
		return ""
	}
	for _, other := range all {
		for _, p := range other.placed {
			if p.uid == vmi.UID {
				continue
			}
			if anti != nil {
				for _, t := range anti.RequiredDuringSchedulingIgnoredDuringExecution {
					if sameDomain(st.node, other.node, t.TopologyKey) && termMatches(t, vmi.Namespace, p) {
						return "didn't match VMI anti-affinity rules"
					}
				}
			}
			for _, t := range p.anti {
				if sameDomain(st.node, other.node, t.TopologyKey) && termMatches(t, p.ns, placed{ns: vmi.Namespace, labels: own}) {
					return "didn't satisfy existing VMIs' anti-affinity rules"
				}
			}
		}
	}
	if aff == nil {
		return ""
	}
	for _, t := range aff.RequiredDuringSchedulingIgnoredDuringExecution {
		found, anywhere := false, false
		for _, other := range all {
			for _, p := range other.placed {
				if p.uid == vmi.UID || !termMatches(t, vmi.Namespace, p) {
					continue
				}
				anywhere = true
				if sameDomain(st.node, other.node, t.TopologyKey) {
					found = true
				}
			}
		}
		// As for pods: the first of a group that matches its own term may
		// go anywhere.
		selfMatch := termMatches(t, vmi.Namespace, placed{ns: vmi.Namespace, labels: own})
		if !found && (anywhere || !selfMatch) {
			return "didn't match VMI affinity rules"
		}
	}
	return ""
}

// score ranks a feasible node: free capacity after placement (spread),
// balance between CPU and memory use, preferred node affinity, preferred
// VMI (anti-)affinity and PreferNoSchedule taints.
func score(req *request, st *nodeState, all []*nodeState) float64 {
	n := st.node
	c, _ := alloc(n, corev1.ResourceCPU)
	m, _ := alloc(n, corev1.ResourceMemory)
	cpuFrac, memFrac := 1.0, 1.0
	if c > 0 {
		cpuFrac = float64(st.cpu+req.demand.cpu) / float64(c)
	}
	if m > 0 {
		memFrac = float64(st.mem+req.demand.mem) / float64(m)
	}
	s := (2-cpuFrac-memFrac)*50 + (1-abs(cpuFrac-memFrac))*50
	spec := &req.vmi.Spec
	if a := spec.Affinity; a != nil {
		if a.NodeAffinity != nil {
			for _, p := range a.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
				if matchTerm(p.Preference, n) {
					s += float64(p.Weight)
				}
			}
		}
		weigh := func(terms []corev1.WeightedPodAffinityTerm, sign float64) {
			for _, w := range terms {
				for _, other := range all {
					if !sameDomain(n, other.node, w.PodAffinityTerm.TopologyKey) {
						continue
					}
					for _, p := range other.placed {
						if p.uid != req.vmi.UID && termMatches(w.PodAffinityTerm, req.vmi.Namespace, p) {
							s += sign * float64(w.Weight)
						}
					}
				}
			}
		}
		if a.PodAffinity != nil {
			weigh(a.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution, 1)
		}
		if a.PodAntiAffinity != nil {
			weigh(a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution, -1)
		}
	}
	for _, t := range n.Spec.Taints {
		if t.Effect == corev1.TaintEffectPreferNoSchedule && !tolerates(spec.Tolerations, t) {
			s -= 20
		}
	}
	return s
}

func abs(f float64) float64 {
	if f < 0 {
		return -f
	}
	return f
}

// volumeConflict is the reason a node cannot take a VMI whose volume is
// held elsewhere, naming the volume when known.
func volumeConflict(volume string) string {
	if volume == "" {
		return "volume node affinity conflict"
	}
	return "volume node affinity conflict (" + volume + ")"
}
