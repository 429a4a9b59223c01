package hco

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func hcoFrom(t *testing.T, manifest string) *hcov1beta1.HyperConverged {
	t.Helper()
	hc := &hcov1beta1.HyperConverged{}
	if err := json.Unmarshal([]byte(manifest), hc); err != nil {
		t.Fatal(err)
	}
	hc.Name, hc.Namespace = hcov1beta1.Name, hcov1beta1.DefaultNamespace
	return hc
}

func TestValidateRefusesWithUpstreamReasons(t *testing.T) {
	for _, tc := range []struct {
		name, manifest, want string
	}{
		{"documented CR", documentedCR, ""},
		{"empty CR", `{}`, ""},
		{"ca renewBefore over duration", `{"spec":{"certConfig":{"ca":{"duration":"24h","renewBefore":"25h"}}}}`,
			"spec.certConfig.ca: duration is smaller than renewBefore"},
		{"server renewBefore over duration", `{"spec":{"certConfig":{"server":{"duration":"1h","renewBefore":"2h"}}}}`,
			"spec.certConfig.server: duration is smaller than renewBefore"},
		{"ca shorter than server", `{"spec":{"certConfig":{"ca":{"duration":"20h","renewBefore":"10h"},"server":{"duration":"22h","renewBefore":"11h"}}}}`,
			"spec.certConfig: ca.duration is smaller than server.duration"},
		{"too small", `{"spec":{"certConfig":{"server":{"duration":"5m","renewBefore":"1m"}}}}`,
			"spec.certConfig.server.duration: value is too small"},
		{"custom type without custom", `{"spec":{"tlsSecurityProfile":{"type":"Custom"}}}`,
			"missing required field spec.tlsSecurityProfile.custom when type is Custom"},
		{"bad min version", `{"spec":{"tlsSecurityProfile":{"type":"Custom","custom":{"minTLSVersion":"TLSv1.2","ciphers":["ECDHE-RSA-AES128-GCM-SHA256"]}}}}`,
			`invalid value for spec.tlsSecurityProfile.custom.minTLSVersion: "TLSv1.2"`},
		{"no http2 cipher", `{"spec":{"tlsSecurityProfile":{"type":"Custom","custom":{"minTLSVersion":"VersionTLS12","ciphers":["AES128-SHA"]}}}}`,
			"http2: TLSConfig.CipherSuites is missing an HTTP/2-required AES_128_GCM_SHA256 cipher"},
		{"ciphers with tls13", `{"spec":{"tlsSecurityProfile":{"type":"Custom","custom":{"minTLSVersion":"VersionTLS13","ciphers":["ECDHE-RSA-AES128-GCM-SHA256"]}}}}`,
			"custom ciphers cannot be selected when minTLSVersion is VersionTLS13"},
		{"good custom profile", `{"spec":{"tlsSecurityProfile":{"type":"Custom","custom":{"minTLSVersion":"VersionTLS12","ciphers":["ECDHE-ECDSA-AES128-GCM-SHA256"]}}}}`, ""},
		{"bad affinity operator", `{"spec":{"workloads":{"nodePlacement":{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"zone","operator":"Near","values":["a"]}]}]}}}}}}}`,
			"invalid workloads node placement affinity"},
		{"Gt with two values", `{"spec":{"infra":{"nodePlacement":{"affinity":{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"cpus","operator":"Gt","values":["1","2"]}]}]}}}}}}}`,
			"invalid infra node placement affinity"},
		{"bad toleration", `{"spec":{"infra":{"nodePlacement":{"tolerations":[{"key":"a","operator":"Exists","value":"x"}]}}}}`,
			"value must be empty when `operator` is 'Exists'"},
		{"bad node selector", `{"spec":{"workloads":{"nodePlacement":{"nodeSelector":{"bad key!":"x"}}}}}`,
			"spec.workloads.nodePlacement.nodeSelector"},
		{"bad bandwidth", `{"spec":{"liveMigrationConfig":{"bandwidthPerMigration":"fast"}}}`,
			"failed to parse the LiveMigrationConfig.bandwidthPerMigration field"},
		{"bad json patch", `{"metadata":{"annotations":{"kubevirt.kubevirt.io/jsonpatch":"[{\"op\":\"nope\"}]"}}}`,
			"invalid jsonPatch in the kubevirt.kubevirt.io/jsonpatch annotation"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Validate(hcoFrom(t, tc.manifest), nil)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("got %v, want %q", err, tc.want)
			}
		})
	}
}

func TestValidateWarnsOnDeprecatedFeatureGates(t *testing.T) {
	w, err := Validate(hcoFrom(t, `{"spec":{"featureGates":{"nonRoot":true,"deployVmConsoleProxy":true}}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.Join(w, "\n")
	if !strings.Contains(joined, "spec.featureGates.nonRoot is deprecated") || !strings.Contains(joined, "use spec.deployVmConsoleProxy instead") {
		t.Errorf("warnings = %q", w)
	}
	old := hcoFrom(t, `{"spec":{"featureGates":{"deployVmConsoleProxy":true}}}`)
	w, _ = Validate(old, old)
	if strings.Contains(strings.Join(w, "\n"), "deployVmConsoleProxy") {
		t.Errorf("unchanged moved gate warned again: %q", w)
	}
}

// serveWebhooks runs the brain's admission server with only the hco-webhook
// until the test ends, and waits until the apiserver calls it.
func serveWebhooks(t *testing.T, e *env) {
	t.Helper()
	s, err := admission.New(admission.Config{Addr: "127.0.0.1:0", Namespace: e.ns},
		admission.Deps{Kube: e.kube, Virt: e.virt, Log: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	if err := Webhooks(e.ns)(s); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		_ = admission.Uninstall(context.Background(), e.kube, e.ns)
		cancel()
		<-done
	})
	bad := hcoFrom(t, `{"spec":{"certConfig":{"ca":{"duration":"1h","renewBefore":"2h"}}}}`)
	bad.Name, bad.Namespace = "probe", e.ns
	testkit.Eventually(t, 30*time.Second, "the expected state", func() error {
		_, err := e.virt.HyperConvergeds.Create(context.Background(), bad)
		if err == nil {
			_ = e.virt.HyperConvergeds.Delete(context.Background(), e.ns, "probe", metav1.DeleteOptions{})
			return context.DeadlineExceeded
		}
		if !strings.Contains(err.Error(), "duration is smaller than renewBefore") {
			return err
		}
		return nil
	})
}

func TestWebhookGuardsUninstallAndNamespace(t *testing.T) {
	e := newEnv(t)
	e.node("node-a", true, "")
	serveWebhooks(t, e)
	ctx := context.Background()
	e.create(hcov1beta1.Name, "")
	e.waitAvailable()

	halted := kubevirtv1.RunStrategyHalted
	vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: "guest", Namespace: e.ns},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &halted, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{}}}
	if _, err := e.virt.VMs.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	err := e.virt.HyperConvergeds.Delete(ctx, e.ns, hcov1beta1.Name, metav1.DeleteOptions{})
	if err == nil || !strings.Contains(err.Error(), "since there are still Virtual Machines present") {
		t.Fatalf("delete with a VM under BlockUninstallIfWorkloadsExist: %v", err)
	}
	err = e.kube.CoreV1().Namespaces().Delete(ctx, e.ns, metav1.DeleteOptions{})
	if err == nil || !strings.Contains(err.Error(), nsDeletionDenied) {
		t.Fatalf("namespace delete with the CR present: %v", err)
	}
	if hc := e.get(hcov1beta1.Name); hc.DeletionTimestamp != nil {
		t.Fatal("refused deletion still marked the CR deleted")
	}

	// An invalid update is refused too, a valid one passes.
	hc := e.get(hcov1beta1.Name)
	hc.Spec.TLSSecurityProfile = &hcov1beta1.TLSSecurityProfile{Type: TLSProfileCustom}
	if _, err := e.virt.HyperConvergeds.Update(ctx, hc); err == nil || !strings.Contains(err.Error(), "spec.tlsSecurityProfile.custom") {
		t.Fatalf("invalid update: %v", err)
	}
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.UninstallStrategy = hcov1beta1.RemoveWorkloads })

	if err := e.virt.HyperConvergeds.Delete(ctx, e.ns, hcov1beta1.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete under RemoveWorkloads: %v", err)
	}
	if _, err := e.virt.VMs.Get(ctx, e.ns, "guest"); !apierrors.IsNotFound(err) {
		t.Errorf("vm survived RemoveWorkloads: %v", err)
	}
	testkit.Eventually(t, wait, "the expected state", func() error {
		_, err := e.virt.HyperConvergeds.Get(ctx, e.ns, hcov1beta1.Name)
		if apierrors.IsNotFound(err) {
			return nil
		}
		return context.DeadlineExceeded
	})
}
