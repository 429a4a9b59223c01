package scheduler

import (
	"strconv"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// matchNodeSelector reports whether node satisfies sel: any term matches
// (terms are ORed, requirements within a term ANDed). A nil selector
// matches everything, an empty term list nothing.
func matchNodeSelector(sel *corev1.NodeSelector, node *corev1.Node) bool {
	if sel == nil {
		return true
	}
	for _, t := range sel.NodeSelectorTerms {
		if matchTerm(t, node) {
			return true
		}
	}
	return false
}

func matchTerm(t corev1.NodeSelectorTerm, node *corev1.Node) bool {
	if len(t.MatchExpressions) == 0 && len(t.MatchFields) == 0 {
		return false
	}
	for _, r := range t.MatchExpressions {
		v, ok := node.Labels[r.Key]
		if !matchRequirement(r, v, ok) {
			return false
		}
	}
	for _, r := range t.MatchFields {
		if r.Key != "metadata.name" || !matchRequirement(r, node.Name, true) {
			return false
		}
	}
	return true
}

func matchRequirement(r corev1.NodeSelectorRequirement, v string, ok bool) bool {
	in := func() bool {
		for _, x := range r.Values {
			if x == v {
				return true
			}
		}
		return false
	}
	switch r.Operator {
	case corev1.NodeSelectorOpIn:
		return ok && in()
	case corev1.NodeSelectorOpNotIn:
		return !ok || !in()
	case corev1.NodeSelectorOpExists:
		return ok
	case corev1.NodeSelectorOpDoesNotExist:
		return !ok
	case corev1.NodeSelectorOpGt, corev1.NodeSelectorOpLt:
		if !ok || len(r.Values) != 1 {
			return false
		}
		have, err1 := strconv.ParseInt(v, 10, 64)
		want, err2 := strconv.ParseInt(r.Values[0], 10, 64)
		if err1 != nil || err2 != nil {
			return false
		}
		if r.Operator == corev1.NodeSelectorOpGt {
			return have > want
		}
		return have < want
	}
	return false
}

// tolerates reports whether some toleration tolerates taint.
func tolerates(tols []corev1.Toleration, taint corev1.Taint) bool {
	for _, t := range tols {
		if t.Effect != "" && t.Effect != taint.Effect {
			continue
		}
		if t.Key != "" && t.Key != taint.Key {
			continue
		}
		switch t.Operator {
		case corev1.TolerationOpExists:
			return true
		case corev1.TolerationOpEqual, "":
			if t.Key == "" { // an empty key needs Exists
				continue
			}
			if t.Value == taint.Value {
				return true
			}
		}
	}
	return false
}

// selectorOf converts a label selector; a nil selector selects nothing.
func selectorOf(s *metav1.LabelSelector) labels.Selector {
	if s == nil {
		return labels.Nothing()
	}
	sel, err := metav1.LabelSelectorAsSelector(s)
	if err != nil {
		return labels.Nothing()
	}
	return sel
}
