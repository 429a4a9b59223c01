package admission

import (
	"context"
	"net/url"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
)

// keepRegistered republishes this brain's webhook configurations whenever
// the webhook server they name no longer answers (the brain that published
// last died), so admission moves to a live brain within
// aggregated.TakeoverInterval.
func (s *Server) keepRegistered(ctx context.Context) {
	t := time.NewTicker(aggregated.TakeoverInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.registrationAlive(ctx) {
			continue
		}
		s.log.Info("registered webhook server gone: taking admission over", "url", s.url)
		if err := s.publish(ctx, s.cm.CABundle()); err != nil && ctx.Err() == nil {
			s.log.Warn("take admission over", "err", err)
		}
	}
}

// registrationAlive reports whether the mutating configuration's server
// answers. A configuration absent (uninstalled) is left absent.
func (s *Server) registrationAlive(ctx context.Context) bool {
	cfg, err := s.deps.Kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, MutatingConfigName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) || err != nil {
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
