package admission

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestTargetClientConfig renders both forms of a webhook's client config.
func TestTargetClientConfig(t *testing.T) {
	bundle := []byte("ca")
	cc := Target{URL: "https://127.0.0.1:8443"}.ClientConfig("/mutate-vm", bundle)
	if cc.URL == nil || *cc.URL != "https://127.0.0.1:8443/mutate-vm" || cc.Service != nil || string(cc.CABundle) != "ca" {
		t.Errorf("url form: %+v", cc)
	}
	reg := &aggregated.Registration{Namespace: "kubevirt-hyperconverged", Service: "nodevirt-brain-webhooks", IP: net.IPv4(10, 0, 0, 5), Port: 8443}
	cc = Target{Service: reg}.ClientConfig("/mutate-vm", bundle)
	if cc.URL != nil || cc.Service == nil || string(cc.CABundle) != "ca" {
		t.Fatalf("service form: %+v", cc)
	}
	if s := cc.Service; s.Namespace != "kubevirt-hyperconverged" || s.Name != "nodevirt-brain-webhooks" ||
		s.Path == nil || *s.Path != "/mutate-vm" || s.Port == nil || *s.Port != 443 {
		t.Errorf("service reference: %+v", *s)
	}
}

// TestServiceConfigRefused checks New's validation of the Service setting.
func TestServiceConfigRefused(t *testing.T) {
	e := setup(t)
	for _, c := range []Config{
		{Namespace: e.ns, Service: "no-slash"},
		{Namespace: e.ns, Service: "/name"},
		{Namespace: e.ns, Service: "ns/"},
		{Namespace: e.ns, Service: "a/b/c"},
		{Namespace: e.ns, Service: "a/b", URL: "https://example.test"},
	} {
		if _, err := New(c, Deps{Kube: e.kube}); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

// TestServiceBackedWebhooks serves the webhooks behind a Service: the API
// server (routing to endpoints, as with --enable-aggregator-routing) calls
// them through the Service's EndpointSlice and verifies the certificate
// against the Service's name; a dead endpoint in the slice makes the
// registration dead, and republishing drops it.
func TestServiceBackedWebhooks(t *testing.T) {
	e := setup(t)
	const svc = "webhooks"
	t.Cleanup(func() {
		_ = aggregated.UnregisterEndpoint(context.Background(), e.kube, aggregated.Registration{Namespace: e.ns, Service: svc})
	})
	// serveConfig returns once the API server denied a bad VM through
	// the webhook: it reached this server through the Service.
	s := serveConfig(t, e, Config{Addr: ":0", Namespace: e.ns, Service: e.ns + "/" + svc})
	ctx := context.Background()

	mut, err := e.kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, MutatingConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	val, err := e.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, ValidatingConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(mut.Webhooks) == 0 || len(val.Webhooks) == 0 {
		t.Fatalf("webhooks: %d mutating, %d validating", len(mut.Webhooks), len(val.Webhooks))
	}
	for _, w := range mut.Webhooks {
		if r := w.ClientConfig.Service; w.ClientConfig.URL != nil || r == nil || r.Namespace != e.ns || r.Name != svc || *r.Port != 443 {
			t.Errorf("mutating %s: client config %+v", w.Name, w.ClientConfig)
		}
	}
	for _, w := range val.Webhooks {
		if r := w.ClientConfig.Service; w.ClientConfig.URL != nil || r == nil || r.Namespace != e.ns || r.Name != svc || *r.Port != 443 {
			t.Errorf("validating %s: client config %+v", w.Name, w.ClientConfig)
		}
	}

	// The certificate names the Service; the endpoint is a host address.
	reg := *s.Target().Service
	if reg.IP.IsLoopback() || reg.Port == 0 {
		t.Fatalf("endpoint %s", reg.Endpoint())
	}
	conn, err := tls.Dial("tcp", reg.Endpoint(), &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	leaf := conn.ConnectionState().PeerCertificates[0]
	conn.Close()
	if err := leaf.VerifyHostname(svc + "." + e.ns + ".svc"); err != nil {
		t.Errorf("serving certificate: %v (names %v)", err, leaf.DNSNames)
	}
	if !s.registrationAlive(ctx) {
		t.Error("registration dead while the only endpoint answers")
	}

	// A dead brain in the slice: the running server's takeover check
	// finds the registration dead and republishes, which drops it.
	slices_ := e.kube.DiscoveryV1().EndpointSlices(e.ns)
	sl, err := slices_.Get(ctx, svc, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ready := true
	sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{Addresses: []string{"192.0.2.1"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
	if _, err := slices_.Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.PollEvery(t, 200*time.Millisecond, 2*time.Minute, "the dead endpoint to be dropped", func() (bool, error) {
		sl, err := slices_.Get(ctx, svc, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		var addrs []string
		for _, ep := range sl.Endpoints {
			addrs = append(addrs, ep.Addresses...)
		}
		return !slices.Contains(addrs, "192.0.2.1") && slices.Contains(addrs, reg.IP.String()), fmt.Errorf("endpoints %v", addrs)
	})

	// A configuration in the URL form (a loopback-mode brain published
	// last) counts as dead for a Service-mode server: it publishes the
	// Service form again.
	flipped := false
	testkit.PollEvery(t, 200*time.Millisecond, 2*time.Minute, "the url-form configuration to be replaced", func() (bool, error) {
		cur, err := e.kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, MutatingConfigName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if cur.Webhooks[0].ClientConfig.URL != nil {
			return false, errors.New("still the url form")
		}
		if !flipped {
			for i := range cur.Webhooks {
				cur.Webhooks[i].ClientConfig = Target{URL: "https://127.0.0.1:1"}.ClientConfig("/x", cur.Webhooks[i].ClientConfig.CABundle)
			}
			_, err := e.kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Update(ctx, cur, metav1.UpdateOptions{})
			flipped = err == nil
			return false, err
		}
		return cur.Webhooks[0].ClientConfig.Service != nil, nil
	})
}
