package scheduler

import (
	"math"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/nodeplacement"
)

// PlaceVolume picks the node for a volume nothing consumes yet (a
// DataVolume bound immediately) by the policy VMIs are placed by: among
// the nodes fit accepts (fit says why a node cannot take the volume, ""
// when it can), the best score for a consumer that asks nothing (most
// free and balanced capacity, PreferNoSchedule taints avoided), ties to
// the node with fewer VMIs, then by name. When no node fits, node is ""
// and why counts the nodes by reason ("0/3 nodes are available: ...").
// ok is false while the scheduler's caches are not synced.
func (s *Scheduler) PlaceVolume(fit func(*corev1.Node) string) (node, why string, ok bool) {
	if !s.ready.Load() {
		return "", "", false
	}
	req := &request{vmi: &kubevirtv1.VirtualMachineInstance{}}
	states := s.snapshot()
	reasons := map[string]int{}
	best := pick(states, func(st *nodeState) (float64, bool) {
		if w := fit(st.node); w != "" {
			reasons[w]++
			return 0, false
		}
		return score(req, st, states), true
	})
	if best < 0 {
		return "", nodeplacement.FitMessage(len(states), reasons, ""), true
	}
	return states[best].node.Name, "", true
}

// pick returns the index of the best feasible node of states by rank, or
// -1: the highest score, ties to the node with fewer VMIs, then by name.
func pick(states []*nodeState, rank func(*nodeState) (score float64, feasible bool)) int {
	best, bestScore, bestCount := -1, math.Inf(-1), 0
	for i, st := range states {
		sc, ok := rank(st)
		if !ok {
			continue
		}
		if sc > bestScore || (sc == bestScore && (len(st.placed) < bestCount ||
			(len(st.placed) == bestCount && st.node.Name < states[best].node.Name))) {
			best, bestScore, bestCount = i, sc, len(st.placed)
		}
	}
	return best
}
