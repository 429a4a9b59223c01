// Package nodeplacement holds the rules that say whether a node may take
// a workload or a volume, shared by the brain's roles and the node agents
// so that both sides apply the same ones:
//
//   - Admits: a workload placement (a node selector, a required node
//     affinity and tolerations: HCO's nodePlacement, the workload fields of
//     the CDI and HostPathProvisioner CRs) lets a workload onto a node.
//   - AllowedTopologies and TopologyAllows: a StorageClass's
//     allowedTopologies, read as the CSI external-provisioner reads them
//     (each term's keys are node labels, kubernetes.io/hostname and the
//     hostpath driver's topology.hostpath.csi/node among them; a node
//     matches when some term matches all its keys).
//   - FitMessage: the kube-scheduler's "0/3 nodes are available: ..."
//     sentence, counting the nodes by the reason they were left out.
package nodeplacement

import (
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
)

// Placement is a workload placement: what HCO's nodePlacement and the
// workload fields of the CDI and HostPathProvisioner CRs hold.
type Placement struct {
	NodeSelector map[string]string
	Affinity     *corev1.Affinity
	Tolerations  []corev1.Toleration
	// Field names the placement in messages ("spec.workload").
	Field string
	// DaemonLike skips the node.kubernetes.io/ condition taints, as a
	// DaemonSet's pods tolerate them; ordinary workloads (an importer, an
	// upload) do not.
	DaemonLike bool
}

// Admits reports whether p lets a workload onto node: the node selector
// and the required node affinity match the node's labels, and every
// NoSchedule/NoExecute taint is tolerated (PreferNoSchedule never keeps a
// workload off). The empty string means yes; otherwise it says why not.
func Admits(p Placement, node *corev1.Node) string {
	keys := make([]string, 0, len(p.NodeSelector))
	for k := range p.NodeSelector {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if got, ok := node.Labels[k]; !ok || got != p.NodeSelector[k] {
			return fmt.Sprintf("%s.nodeSelector %s=%s does not match", p.Field, k, p.NodeSelector[k])
		}
	}
	if a := p.Affinity; a != nil && a.NodeAffinity != nil && a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution != nil {
		ok, err := nodeaffinity.NewLazyErrorNodeSelector(a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution).Match(node)
		if err != nil {
			return p.Field + ".affinity: " + err.Error()
		}
		if !ok {
			return p.Field + ".affinity does not match"
		}
	}
	taint, untolerated := corev1helpers.FindMatchingUntoleratedTaint(node.Spec.Taints, p.Tolerations, func(t *corev1.Taint) bool {
		return (t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute) &&
			!(p.DaemonLike && strings.HasPrefix(t.Key, "node.kubernetes.io/"))
	})
	if untolerated {
		return fmt.Sprintf("taint %s:%s not tolerated by %s.tolerations", taint.Key, taint.Effect, p.Field)
	}
	return ""
}

// AllowedTopologies is sc's allowedTopologies as a node selector (a term
// per topology term, each key's values In), or nil when the class allows
// every node.
func AllowedTopologies(sc *storagev1.StorageClass) *corev1.NodeSelector {
	if sc == nil || len(sc.AllowedTopologies) == 0 {
		return nil
	}
	sel := &corev1.NodeSelector{}
	for _, t := range sc.AllowedTopologies {
		term := corev1.NodeSelectorTerm{}
		for _, e := range t.MatchLabelExpressions {
			term.MatchExpressions = append(term.MatchExpressions, corev1.NodeSelectorRequirement{
				Key: e.Key, Operator: corev1.NodeSelectorOpIn, Values: e.Values})
		}
		sel.NodeSelectorTerms = append(sel.NodeSelectorTerms, term)
	}
	return sel
}

// TopologyAllows reports whether sc's allowedTopologies let a volume onto
// node. A class without allowedTopologies allows every node; a term
// without expressions matches none (as a node selector's).
func TopologyAllows(sc *storagev1.StorageClass, node *corev1.Node) bool {
	sel := AllowedTopologies(sc)
	if sel == nil {
		return true
	}
	ok, err := nodeaffinity.NewLazyErrorNodeSelector(sel).Match(node)
	return err == nil && ok
}

// NotInTopologies is the reason a node outside sc's allowedTopologies
// cannot take its volume.
func NotInTopologies(sc *storagev1.StorageClass) string {
	return fmt.Sprintf("not in storage class %s's allowedTopologies", sc.Name)
}

// FitMessage renders "0/3 nodes are available: 2 insufficient memory, 1
// lacks bridge br1." from the nodes left out by reason (most frequent
// first), with prefix, when set, before the counts.
func FitMessage(nodes int, reasons map[string]int, prefix string) string {
	type kv struct {
		k string
		v int
	}
	var list []kv
	for k, v := range reasons {
		list = append(list, kv{k, v})
	}
	sort.Slice(list, func(i, j int) bool {
		if list[i].v != list[j].v {
			return list[i].v > list[j].v
		}
		return list[i].k < list[j].k
	})
	parts := make([]string, 0, len(list))
	for _, e := range list {
		parts = append(parts, fmt.Sprintf("%d %s", e.v, e.k))
	}
	msg := fmt.Sprintf("0/%d nodes are available", nodes)
	if prefix != "" {
		msg += ": " + prefix
	}
	if len(parts) > 0 {
		msg += ": " + strings.Join(parts, ", ")
	}
	return msg + "."
}
