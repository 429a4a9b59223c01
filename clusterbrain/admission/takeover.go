package admission

import (
	"context"
	"net/url"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
)

// registrationAlive reports whether the mutating configuration's server
// answers: the server at its URL, or every endpoint of its Service (the
// API servers pick one per call, so one dead brain in the EndpointSlice
// fails calls until a live brain registers again and drops it). A
// configuration in the other form than this server's (an upgrade between
// the two) counts as dead, so that this server publishes its own. A
// configuration that cannot be read (absent after an uninstall, or an API
// error) counts as alive: nothing is republished.
func (s *Server) registrationAlive(ctx context.Context) bool {
	cfg, err := s.deps.Kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, MutatingConfigName, metav1.GetOptions{})
	if err != nil {
		return true
	}
	mine := s.Target()
	for _, h := range cfg.Webhooks {
		cc := h.ClientConfig
		switch {
		case cc.Service != nil:
			if mine.Service == nil || cc.Service.Namespace != mine.Service.Namespace || cc.Service.Name != mine.Service.Service {
				return false
			}
			ok, err := aggregated.EndpointsAllAnswer(ctx, s.deps.Kube, cc.Service.Namespace, cc.Service.Name)
			return err != nil || ok
		case cc.URL != nil:
			if mine.Service != nil {
				return false
			}
			u, err := url.Parse(*cc.URL)
			if err != nil || u.Host == "" {
				continue
			}
			return aggregated.Answers(u.Host)
		}
	}
	return true
}
