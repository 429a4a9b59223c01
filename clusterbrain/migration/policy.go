package migration

import (
	"context"
	"fmt"
	"sort"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kubevirtv1 "kubevirt.io/api/core/v1"
	migrationsv1alpha1 "kubevirt.io/api/migrations/v1alpha1"
)

// MigrationPolicies (migrations.kubevirt.io/v1alpha1) tune the migrations of
// the VMIs they select, over the KubeVirt CR's migrations block. As
// upstream: a policy applies when every label of its namespaceSelector is on
// the VMI's namespace and every label of its
// virtualMachineInstanceSelector on the VMI; of those, the one matching the
// most labels wins, ties going to the first name.

var policyResource = schema.GroupVersionResource{Group: "migrations.kubevirt.io", Version: "v1alpha1", Resource: "migrationpolicies"}

// policies lists the MigrationPolicies; none without a dynamic client.
func (c *Controller) policies(ctx context.Context) ([]migrationsv1alpha1.MigrationPolicy, error) {
	if c.cfg.Dynamic == nil {
		return nil, nil
	}
	list, err := c.cfg.Dynamic.Resource(policyResource).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("migration policies: %w", err)
	}
	out := make([]migrationsv1alpha1.MigrationPolicy, 0, len(list.Items))
	for _, u := range list.Items {
		var p migrationsv1alpha1.MigrationPolicy
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &p); err != nil {
			return nil, fmt.Errorf("migration policy %s: %w", u.GetName(), err)
		}
		out = append(out, p)
	}
	return out, nil
}

// MatchPolicy picks the policy for a VMI with labels vmiLabels in a
// namespace with labels nsLabels; nil when none applies.
func MatchPolicy(policies []migrationsv1alpha1.MigrationPolicy, vmiLabels, nsLabels map[string]string) *migrationsv1alpha1.MigrationPolicy {
	sort.Slice(policies, func(i, j int) bool { return policies[i].Name < policies[j].Name })
	var best *migrationsv1alpha1.MigrationPolicy
	bestCount := -1
	for i := range policies {
		p := &policies[i]
		if p.Spec.Selectors == nil {
			continue
		}
		n, ok := countMatches(p.Spec.Selectors.NamespaceSelector, nsLabels)
		m, ok2 := countMatches(p.Spec.Selectors.VirtualMachineInstanceSelector, vmiLabels)
		if !ok || !ok2 {
			continue
		}
		if n+m > bestCount {
			best, bestCount = p, n+m
		}
	}
	return best
}

// countMatches is how many labels of sel are on labels; false when one is
// not.
func countMatches(sel migrationsv1alpha1.LabelSelector, labels map[string]string) (int, bool) {
	for k, v := range sel {
		if got, ok := labels[k]; !ok || got != v {
			return 0, false
		}
	}
	return len(sel), true
}

// applyPolicy sets what p sets on conf.
func applyPolicy(conf *kubevirtv1.VMIMConfigurationOptions, p *migrationsv1alpha1.MigrationPolicy) {
	s := p.Spec
	if s.AllowAutoConverge != nil {
		conf.AllowAutoConverge = s.AllowAutoConverge
	}
	if s.BandwidthPerMigration != nil {
		conf.BandwidthPerMigration = s.BandwidthPerMigration
	}
	if s.CompletionTimeoutPerGiB != nil {
		conf.CompletionTimeoutPerGiB = s.CompletionTimeoutPerGiB
	}
	if s.MaxDowntimeMs != nil {
		conf.MaxDowntimeMs = s.MaxDowntimeMs
	}
	if s.AllowPostCopy != nil {
		conf.AllowPostCopy = s.AllowPostCopy
	}
	if s.AllowWorkloadDisruption != nil {
		conf.AllowWorkloadDisruption = s.AllowWorkloadDisruption
	}
}
