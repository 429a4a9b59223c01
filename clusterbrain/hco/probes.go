package hco

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Probe checks one part a child stands for (the DataVolume controller for
// CDI, the MAC pool for the network add-ons, the template validator for
// SSP). Check returns nil when the part is in place, else why not.
type Probe struct {
	// What names the part in the child's and the HCO's messages.
	What  string
	Check func(ctx context.Context) error
}

// nodeRoles names, per child, what the node agents run for it: the child
// is not available while no node agent is ready.
var nodeRoles = map[string]string{
	kindKubeVirt: "",
	kindCDI:      "importer and upload server",
	kindCNAO:     "bridge CNI and bridge-marker",
}

// probeAll runs every probe of each kind and returns the failures by kind.
func probeAll(ctx context.Context, probes map[string][]Probe) map[string][]string {
	out := map[string][]string{}
	for kind, ps := range probes {
		for _, p := range ps {
			if err := p.Check(ctx); err != nil {
				out[kind] = append(out[kind], fmt.Sprintf("%s: %v", p.What, err))
			}
		}
	}
	return out
}

// RoleChecker reports whether a named role of this brain runs (nil) or why
// it stopped; daemon.Health is one.
type RoleChecker interface {
	Check(role string) error
}

// RoleRunning probes that the brain's role is running.
func RoleRunning(h RoleChecker, what, role string) Probe {
	return Probe{What: what, Check: func(context.Context) error {
		if err := h.Check(role); err != nil {
			return fmt.Errorf("role %s stopped: %w", role, err)
		}
		return nil
	}}
}

// WebhookPublished probes that the API server sends requests to the named
// webhook: it is in the brain's Mutating (or Validating) webhook
// configuration with a CA bundle.
func WebhookPublished(kube kubernetes.Interface, what string, mutating bool, config, webhook string) Probe {
	return Probe{What: what, Check: func(ctx context.Context) error {
		ar := kube.AdmissionregistrationV1()
		var bundles = map[string][]byte{}
		if mutating {
			c, err := ar.MutatingWebhookConfigurations().Get(ctx, config, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return fmt.Errorf("webhook configuration %s is missing", config)
			}
			if err != nil {
				return err
			}
			for _, w := range c.Webhooks {
				bundles[w.Name] = w.ClientConfig.CABundle
			}
		} else {
			c, err := ar.ValidatingWebhookConfigurations().Get(ctx, config, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return fmt.Errorf("webhook configuration %s is missing", config)
			}
			if err != nil {
				return err
			}
			for _, w := range c.Webhooks {
				bundles[w.Name] = w.ClientConfig.CABundle
			}
		}
		b, ok := bundles[webhook]
		switch {
		case !ok:
			return fmt.Errorf("webhook %s is not registered", webhook)
		case len(b) == 0:
			return fmt.Errorf("webhook %s has no CA bundle", webhook)
		}
		return nil
	}}
}
