package hco

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// brainManifest is the brain's Deployment as the manifests ship it.
func brainManifest(t *testing.T) *appsv1.Deployment {
	t.Helper()
	b, err := os.ReadFile("../deploy/base/clusterbrain.yaml")
	if err != nil {
		t.Fatal(err)
	}
	d := &appsv1.Deployment{}
	if err := yaml.Unmarshal(bytes.Split(b, []byte("\n---\n"))[0], d); err != nil {
		t.Fatal(err)
	}
	if d.Kind != "Deployment" {
		t.Fatalf("first document of the brain's manifest is a %s", d.Kind)
	}
	return d
}

// TestInfraPlacementPlacesTheBrain: spec.infra.nodePlacement, which
// upstream gives to virt-controller, virt-api and the other control-plane
// pods, reaches the brain's own Deployment (the manifests' one, through a
// real API server), merged onto the template's own placement as KubeVirt's
// operator merges it: the node selector added, the tolerations appended to
// the control-plane one, the required node affinity added beside the
// manifest's preferred term and its one-brain-per-node anti-affinity.
// Removing the placement gives the template back exactly its own.
func TestInfraPlacementPlacesTheBrain(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.BrainDeployment = "nodevirt-clusterbrain" })
	ctx := context.Background()
	d := brainManifest(t)
	d.Namespace = e.ns
	own := placementOf(&d.Spec.Template.Spec)
	deployments := e.kube.AppsV1().Deployments(e.ns)
	if _, err := deployments.Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.create(hcov1beta1.Name, `{"spec":{"infra":{"nodePlacement":{
		"nodeSelector":{"infra":"yes"},
		"tolerations":[{"key":"infra","operator":"Exists","effect":"NoSchedule"}],
		"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[
			{"matchExpressions":[{"key":"zone","operator":"In","values":["a"]}]}]}}}}}}}`)
	placed := func(what string, ok func(p podPlacement) error) {
		t.Helper()
		testkit.Eventually(t, time.Minute, what, func() error {
			cur, err := deployments.Get(ctx, d.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			return ok(placementOf(&cur.Spec.Template.Spec))
		})
	}
	placed("the brain placed by spec.infra", func(p podPlacement) error {
		na := p.Affinity.NodeAffinity
		switch {
		case p.NodeSelector["infra"] != "yes":
			return fmt.Errorf("node selector %v", p.NodeSelector)
		case len(p.Tolerations) != 2 || p.Tolerations[0].Key != "node-role.kubernetes.io/control-plane" || p.Tolerations[1].Key != "infra":
			return fmt.Errorf("tolerations %+v, want the manifest's then the placement's", p.Tolerations)
		case na == nil || na.RequiredDuringSchedulingIgnoredDuringExecution == nil ||
			len(na.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms) != 1 ||
			na.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[0].MatchExpressions[0].Key != "zone":
			return fmt.Errorf("node affinity %+v", na)
		case !equality.Semantic.DeepEqual(na.PreferredDuringSchedulingIgnoredDuringExecution, own.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution) ||
			!equality.Semantic.DeepEqual(p.Affinity.PodAntiAffinity, own.Affinity.PodAntiAffinity):
			return fmt.Errorf("the manifest's own affinity lost: %+v", p.Affinity)
		}
		return nil
	})

	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.Infra.NodePlacement = nil })
	placed("the template's own placement back", func(p podPlacement) error {
		if !equality.Semantic.DeepEqual(p, own) {
			return fmt.Errorf("placement %+v, want the manifest's %+v", p, own)
		}
		return nil
	})
}

// A node selector key the template sets itself is kept, as KubeVirt's
// operator keeps the keys it sets; nil placement changes nothing.
func TestPlacedOnKeepsTheTemplatesOwnKeys(t *testing.T) {
	base := podPlacement{NodeSelector: map[string]string{"kubernetes.io/os": "linux"},
		Tolerations: []corev1.Toleration{{Key: "a", Operator: corev1.TolerationOpExists}}}
	got := placedOn(base, &hcov1beta1.NodePlacement{NodeSelector: map[string]string{"kubernetes.io/os": "windows", "infra": "yes"}})
	if got.NodeSelector["kubernetes.io/os"] != "linux" || got.NodeSelector["infra"] != "yes" || len(got.Tolerations) != 1 {
		t.Errorf("placed %+v", got)
	}
	if base.NodeSelector["infra"] != "" {
		t.Error("the base was changed")
	}
	if got := placedOn(base, nil); !equality.Semantic.DeepEqual(got, base) {
		t.Errorf("nil placement gave %+v", got)
	}
	// Pod anti-affinity terms are appended to the template's own.
	term := func(key string) corev1.PodAffinityTerm { return corev1.PodAffinityTerm{TopologyKey: key} }
	base.Affinity = &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{term("own")}}}
	got = placedOn(base, &hcov1beta1.NodePlacement{Affinity: &corev1.Affinity{
		PodAntiAffinity: &corev1.PodAntiAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{term("placed")}}}})
	if terms := got.Affinity.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution; len(terms) != 2 ||
		terms[0].TopologyKey != "own" || terms[1].TopologyKey != "placed" {
		t.Errorf("pod anti-affinity %+v, want the template's term then the placement's", terms)
	}
	if len(base.Affinity.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) != 1 {
		t.Error("the base's affinity was changed")
	}
}
