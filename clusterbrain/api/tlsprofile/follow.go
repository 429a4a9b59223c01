package tlsprofile

import (
	"crypto/tls"
	"log/slog"

	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
)

// Follow keeps kubevirt in step with w's KubeVirt CR and cdi with its CDI
// CR, logging every change.
func Follow(w *crwatch.Watch, kubevirt, cdi *Live, log *slog.Logger) {
	changed := func(cr string, s Settings) {
		log.Info("tls settings changed", "from", cr, "minVersion", tls.VersionName(s.MinVersion), "suites", len(s.CipherSuites))
	}
	w.OnKubeVirt(func(kv *kubevirtv1.KubeVirt) {
		if s := FromKubeVirt(kv); kubevirt.Set(s) {
			changed("KubeVirt", s)
		}
	})
	w.OnCDI(func(c *cdiv1.CDI) {
		if s := FromCDI(c); cdi.Set(s) {
			changed("CDI", s)
		}
	})
}
