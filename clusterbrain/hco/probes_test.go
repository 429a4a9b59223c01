package hco

import (
	"context"
	"errors"
	"fmt"
	"github.com/nodevirt/nodevirt/test/testkit"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apis "github.com/nodevirt/nodevirt/clusterbrain/api"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon"
)

// TestChildrenFollowWhatTheyStandFor stops a brain role behind CDI and
// removes the webhook behind SSP: each child and the HyperConverged go
// unavailable naming the part, and come back when it does.
func TestChildrenFollowWhatTheyStandFor(t *testing.T) {
	health := daemon.NewHealth()
	webhookConfig := "nodevirt-test-probe-" + fmt.Sprint(time.Now().UnixNano())
	var e *env
	e = newEnv(t, func(c *Config) {
		c.ProbeEvery = 200 * time.Millisecond
		c.Probes = map[string][]Probe{
			kindCDI: {RoleRunning(health, "DataVolume controller", "datavolume")},
			kindSSP: {WebhookPublished(c.Kube, "template validator", false, webhookConfig, "virtualmachine-validator.ssp.kubevirt.io")},
		}
	})
	ctx := context.Background()
	e.create(hcov1beta1.Name, "")

	// No ready node agent: CDI and HPP say which of their parts need one.
	testkit.Eventually(t, wait, "the probe's answer", func() error {
		return conditionIs(e.get(hcov1beta1.Name), hcov1beta1.ConditionAvailable, metav1.ConditionFalse,
			"CDI is not available: no nodeagent is ready (importer and upload server)")
	})
	e.node("node-a", true, "")
	testkit.Eventually(t, wait, "the probe's answer", func() error {
		return conditionIs(e.get(hcov1beta1.Name), hcov1beta1.ConditionAvailable, metav1.ConditionFalse,
			"SSP is not available: template validator: webhook configuration "+webhookConfig+" is missing")
	})

	none := admissionregistrationv1.SideEffectClassNone
	url := "https://127.0.0.1:1/validate"
	vwc := &admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: webhookConfig},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{Name: "virtualmachine-validator.ssp.kubevirt.io",
			ClientConfig: admissionregistrationv1.WebhookClientConfig{URL: &url, CABundle: []byte("not checked")},
			SideEffects:  &none, AdmissionReviewVersions: []string{"v1"},
			// Matches nothing this test sends.
			Rules: []admissionregistrationv1.RuleWithOperations{{Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule: admissionregistrationv1.Rule{APIGroups: []string{"nodevirt.test"}, APIVersions: []string{"v1"}, Resources: []string{"nothings"}}}}}}}
	if _, err := e.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, vwc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(context.Background(), webhookConfig, metav1.DeleteOptions{})
	})
	e.waitAvailable()
	ssp, err := e.virt.SSPs.Get(ctx, e.ns, SSPName)
	if err != nil {
		t.Fatal(err)
	}
	if c := findCondition(ssp.Status.Conditions, "Available"); c == nil || c.Status != "True" || c.Message == "" {
		t.Errorf("SSP Available = %+v, want True saying what runs", c)
	}

	health.Set("datavolume", errors.New("informer sync failed"))
	testkit.Eventually(t, wait, "the probe's answer", func() error {
		if err := conditionIs(e.get(hcov1beta1.Name), hcov1beta1.ConditionAvailable, metav1.ConditionFalse,
			"CDI is not available: DataVolume controller: role datavolume stopped: informer sync failed"); err != nil {
			return err
		}
		cdi, err := e.virt.CDIs.Get(ctx, "", CDIName)
		if err != nil {
			return err
		}
		for _, c := range cdi.Status.Conditions {
			if c.Type == "Available" && c.Status == "False" && c.Message == "DataVolume controller: role datavolume stopped: informer sync failed" {
				return nil
			}
		}
		return fmt.Errorf("cdi conditions %+v", cdi.Status.Conditions)
	})
	health.Set("datavolume", nil)
	e.waitAvailable()
}

func findCondition(conds []apis.Condition, typ string) *apis.Condition {
	for i := range conds {
		if conds[i].Type == typ {
			return &conds[i]
		}
	}
	return nil
}
