package hco

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// PlacementBaseAnnotation, on the brain's Deployment, holds the pod
// template's own nodeSelector, affinity and tolerations (JSON), onto which
// the HyperConverged's spec.infra.nodePlacement is merged, so that a
// placement removed gives the template back its own. The manifests carry
// it beside the template; without it, what the template holds when the
// brain first places itself is recorded as the base.
const PlacementBaseAnnotation = "nodevirt.io/placement-base"

// podPlacement is the part of a pod spec a node placement sets.
type podPlacement struct {
	NodeSelector map[string]string   `json:"nodeSelector,omitempty"`
	Affinity     *corev1.Affinity    `json:"affinity,omitempty"`
	Tolerations  []corev1.Toleration `json:"tolerations,omitempty"`
}

func placementOf(spec *corev1.PodSpec) podPlacement {
	return podPlacement{NodeSelector: spec.NodeSelector, Affinity: spec.Affinity, Tolerations: spec.Tolerations}
}

// placedOn is base with np merged in as KubeVirt's operator merges a
// component's placement into its pods: the base's own node selector keys
// win, np's other keys are added; np's required node selector terms,
// preferred terms and pod (anti-)affinity terms are appended to the
// base's; np's tolerations are appended. A nil np leaves base as it is.
func placedOn(base podPlacement, np *hcov1beta1.NodePlacement) podPlacement {
	out := podPlacement{NodeSelector: maps.Clone(base.NodeSelector), Affinity: base.Affinity.DeepCopy(),
		Tolerations: append([]corev1.Toleration(nil), base.Tolerations...)}
	if np == nil {
		return out
	}
	for k, v := range np.NodeSelector {
		if out.NodeSelector == nil {
			out.NodeSelector = map[string]string{}
		}
		if _, own := out.NodeSelector[k]; !own {
			out.NodeSelector[k] = v
		}
	}
	out.Tolerations = append(out.Tolerations, np.Tolerations...)
	if np.Affinity == nil {
		return out
	}
	if out.Affinity == nil {
		out.Affinity = np.Affinity.DeepCopy()
		return out
	}
	if na := np.Affinity.NodeAffinity; na != nil {
		if out.Affinity.NodeAffinity == nil {
			out.Affinity.NodeAffinity = &corev1.NodeAffinity{}
		}
		dst := out.Affinity.NodeAffinity
		if req := na.RequiredDuringSchedulingIgnoredDuringExecution; req != nil {
			if dst.RequiredDuringSchedulingIgnoredDuringExecution == nil {
				dst.RequiredDuringSchedulingIgnoredDuringExecution = &corev1.NodeSelector{}
			}
			dst.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms = append(
				dst.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms, req.DeepCopy().NodeSelectorTerms...)
		}
		dst.PreferredDuringSchedulingIgnoredDuringExecution = append(dst.PreferredDuringSchedulingIgnoredDuringExecution,
			na.DeepCopy().PreferredDuringSchedulingIgnoredDuringExecution...)
	}
	if pa := np.Affinity.PodAffinity; pa != nil {
		if out.Affinity.PodAffinity == nil {
			out.Affinity.PodAffinity = &corev1.PodAffinity{}
		}
		appendPodTerms(out.Affinity.PodAffinity, pa)
	}
	if pa := np.Affinity.PodAntiAffinity; pa != nil {
		if out.Affinity.PodAntiAffinity == nil {
			out.Affinity.PodAntiAffinity = &corev1.PodAntiAffinity{}
		}
		// The two kinds hold the same term lists.
		appendPodTerms((*corev1.PodAffinity)(out.Affinity.PodAntiAffinity), (*corev1.PodAffinity)(pa))
	}
	return out
}

// appendPodTerms appends copies of src's required and preferred terms to
// dst's.
func appendPodTerms(dst, src *corev1.PodAffinity) {
	src = src.DeepCopy()
	dst.RequiredDuringSchedulingIgnoredDuringExecution = append(dst.RequiredDuringSchedulingIgnoredDuringExecution, src.RequiredDuringSchedulingIgnoredDuringExecution...)
	dst.PreferredDuringSchedulingIgnoredDuringExecution = append(dst.PreferredDuringSchedulingIgnoredDuringExecution, src.PreferredDuringSchedulingIgnoredDuringExecution...)
}

// placeBrain gives the brain's own Deployment (Config.BrainDeployment) the
// HyperConverged's infra placement, as upstream's operators give it to
// virt-controller, virt-api, CDI's and the network add-ons' controllers and
// the template validator, all of which the brain is. The Deployment then
// rolls its pods onto the nodes the placement admits. Nothing is done
// without a Deployment named (a brain not run by one).
func (c *Controller) placeBrain(ctx context.Context, hc *hcov1beta1.HyperConverged, log *slog.Logger) error {
	if c.cfg.BrainDeployment == "" {
		if hc.Spec.Infra.NodePlacement != nil && !c.unplacedLogged {
			log.Warn("spec.infra.nodePlacement has no effect: the brain was not given its Deployment (--deployment)")
			c.unplacedLogged = true
		}
		return nil
	}
	deployments := c.cfg.Kube.AppsV1().Deployments(c.cfg.Namespace)
	d, err := deployments.Get(ctx, c.cfg.BrainDeployment, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("place the brain: %w", err)
	}
	tmpl := &d.Spec.Template.Spec
	base := placementOf(tmpl)
	raw, recorded := d.Annotations[PlacementBaseAnnotation]
	if recorded {
		base = podPlacement{}
		if err := json.Unmarshal([]byte(raw), &base); err != nil {
			return fmt.Errorf("place the brain: deployment %s: annotation %s: %w", d.Name, PlacementBaseAnnotation, err)
		}
	}
	want := placedOn(base, hc.Spec.Infra.NodePlacement)
	if recorded && equality.Semantic.DeepEqual(want, placementOf(tmpl)) {
		return nil
	}
	if !recorded {
		b, err := json.Marshal(base)
		if err != nil {
			return fmt.Errorf("place the brain: %w", err)
		}
		if d.Annotations == nil {
			d.Annotations = map[string]string{}
		}
		d.Annotations[PlacementBaseAnnotation] = string(b)
	}
	tmpl.NodeSelector, tmpl.Affinity, tmpl.Tolerations = want.NodeSelector, want.Affinity, want.Tolerations
	if _, err := deployments.Update(ctx, d, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("place the brain: deployment %s: %w", d.Name, err)
	}
	log.Info("brain deployment placed by spec.infra.nodePlacement", "deployment", d.Name,
		"nodeSelector", want.NodeSelector, "tolerations", len(want.Tolerations))
	return nil
}
