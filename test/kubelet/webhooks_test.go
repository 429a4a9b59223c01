package kubelet

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/subresources"
)

// webhookService is the Service the manifest's brains put in front of
// their webhooks (clusterbrain/deploy/base/clusterbrain.yaml).
const webhookService = "nodevirt-brain-webhooks"

// webhooksBehindService checks that every webhook of the brain's
// configurations names the Service (no URL), that its EndpointSlice lists
// the node the brain runs on, and that the API server reaches the webhooks
// through it: a VM whose disk has no volume is denied by the brain's
// validating webhook (dry run).
func webhooksBehindService(t *testing.T, ctx context.Context, kube kubernetes.Interface, kubectl func(...string) (string, error), nodeIP string) {
	t.Helper()
	named := func(kind, name string, cc admissionregistrationv1.WebhookClientConfig) {
		if s := cc.Service; cc.URL != nil || s == nil || s.Namespace != nodevirtNS || s.Name != webhookService || s.Port == nil || *s.Port != 443 {
			t.Errorf("%s webhook %s: client config %+v, want service %s/%s:443", kind, name, cc, nodevirtNS, webhookService)
		}
	}
	mut, err := kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, admission.MutatingConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	val, err := kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, admission.ValidatingConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(mut.Webhooks) == 0 || len(val.Webhooks) == 0 {
		t.Fatalf("webhooks: %d mutating, %d validating", len(mut.Webhooks), len(val.Webhooks))
	}
	for _, w := range mut.Webhooks {
		named("mutating", w.Name, w.ClientConfig)
	}
	for _, w := range val.Webhooks {
		named("validating", w.Name, w.ClientConfig)
	}
	out, err := kubectl("get", "mutatingwebhookconfiguration", admission.MutatingConfigName, "-o", "jsonpath={.webhooks[0].clientConfig.service}")
	t.Logf("kubectl: %s's first webhook clientConfig.service: %s (%v)", admission.MutatingConfigName, out, err)
	// The brain advertises the same host address for its webhooks as for
	// its aggregated APIs.
	addrs := func(slice string) string {
		out, err := kubectl("get", "-n", nodevirtNS, "endpointslice", slice, "-o", "jsonpath={.endpoints[*].addresses}")
		if err != nil {
			t.Errorf("endpointslice %s: %v", slice, err)
		}
		return out
	}
	hooks, apis := addrs(webhookService), addrs(subresources.ServiceName)
	if hooks == "" || hooks != apis {
		t.Errorf("endpointslice %s lists %q, %s lists %q: want the same brain address", webhookService, hooks, subresources.ServiceName, apis)
	}
	t.Logf("kubectl: endpointslice %s: %s (node %s)", webhookService, hooks, nodeIP)

	bad := filepath.Join(t.TempDir(), "bad-vm.yaml")
	if err := os.WriteFile(bad, []byte(badVMManifest), 0o644); err != nil {
		t.Fatal(err)
	}
	wait(t, ctx, 2*time.Minute, "a VM without the volume of its disk denied by the webhook", func() error {
		out, err := kubectl("create", "--dry-run=server", "-f", bad)
		if err == nil {
			return fmt.Errorf("accepted: %s", out)
		}
		// The brain answers with KubeVirt's field causes, which the API
		// server passes on as an Invalid status (no CRD schema knows
		// that a disk needs a volume).
		if !strings.Contains(err.Error()+out, "denied the request") && !strings.Contains(err.Error()+out, `disks[0].name: Not found: "rootdisk"`) {
			return fmt.Errorf("refused, but not by a webhook: %v %s", err, out)
		}
		t.Logf("kubectl create --dry-run=server: %v %s", err, strings.TrimSpace(out))
		return nil
	})
}

const badVMManifest = `apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: bad
  namespace: default
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        resources:
          requests:
            memory: 64Mi
        devices:
          disks:
          - name: rootdisk
            disk:
              bus: virtio
`
