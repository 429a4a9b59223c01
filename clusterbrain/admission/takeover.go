package admission

import (
	"context"
	"net/url"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
)

// registrationAlive reports whether the mutating configuration's server
// answers. A configuration that cannot be read (absent after an
// uninstall, or an API error) counts as alive: nothing is republished.
func (s *Server) registrationAlive(ctx context.Context) bool {
	cfg, err := s.deps.Kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, MutatingConfigName, metav1.GetOptions{})
	if err != nil {
		return true
	}
	for _, h := range cfg.Webhooks {
		if h.ClientConfig.URL == nil {
			continue
		}
		u, err := url.Parse(*h.ClientConfig.URL)
		if err != nil || u.Host == "" {
			continue
		}
		return aggregated.Answers(u.Host)
	}
	return true
}
