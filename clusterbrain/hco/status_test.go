package hco

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func conditionIs(hc *hcov1beta1.HyperConverged, typ string, status metav1.ConditionStatus, msgPart string) error {
	c := condition(hc, typ)
	if c == nil || c.Status != status || !strings.Contains(c.Message, msgPart) {
		return fmt.Errorf("%s = %+v, want %s with %q", typ, c, status, msgPart)
	}
	return nil
}

func TestConditionsFollowNodeAgentsAndBrainHealth(t *testing.T) {
	e := newEnv(t)
	// No nodeagent yet: the platform is not available, and says why.
	e.create(hcov1beta1.Name, "")
	testkit.Eventually(t, wait, "the expected state", func() error {
		hc := e.get(hcov1beta1.Name)
		if err := conditionIs(hc, hcov1beta1.ConditionAvailable, metav1.ConditionFalse, "KubeVirt is not available: no nodeagent is ready"); err != nil {
			return err
		}
		if hc.Status.SystemHealthStatus != healthError {
			return fmt.Errorf("health %q", hc.Status.SystemHealthStatus)
		}
		return conditionIs(hc, hcov1beta1.ConditionReconcileComplete, metav1.ConditionTrue, "")
	})

	e.node("node-a", true, "")
	e.node("node-b", true, "")
	e.waitAvailable()
	if hc := e.get(hcov1beta1.Name); hc.Status.SystemHealthStatus != healthHealthy {
		t.Errorf("health %q when available", hc.Status.SystemHealthStatus)
	}

	// One nodeagent fails: degraded with its message; the KubeVirt child says so too.
	e.node("node-b", false, "nodeagent heartbeat stale for 45s")
	testkit.Eventually(t, wait, "the expected state", func() error {
		hc := e.get(hcov1beta1.Name)
		if err := conditionIs(hc, hcov1beta1.ConditionDegraded, metav1.ConditionTrue, "node-b: nodeagent heartbeat stale for 45s"); err != nil {
			return err
		}
		if err := conditionIs(hc, hcov1beta1.ConditionUpgradeable, metav1.ConditionFalse, "degraded"); err != nil {
			return err
		}
		kv, err := e.virt.KubeVirts.Get(context.Background(), e.ns, KubeVirtName)
		if err != nil {
			return err
		}
		for _, c := range kv.Status.Conditions {
			if c.Type == kubevirtv1.KubeVirtConditionDegraded && c.Status == "True" && strings.Contains(c.Message, "node-b") {
				return nil
			}
		}
		return fmt.Errorf("kubevirt conditions %+v", kv.Status.Conditions)
	})

	// The brain's own failing check joins the message; every failure is kept.
	e.setBrainErr(errors.New("webhooks: certificate not issued"))
	e.node("node-a", true, "") // a Node event triggers the reconcile
	testkit.Eventually(t, wait, "the expected state", func() error {
		hc := e.get(hcov1beta1.Name)
		if err := conditionIs(hc, hcov1beta1.ConditionDegraded, metav1.ConditionTrue, "webhooks: certificate not issued"); err != nil {
			return err
		}
		return conditionIs(hc, hcov1beta1.ConditionDegraded, metav1.ConditionTrue, "node-b")
	})

	e.setBrainErr(nil)
	e.node("node-b", true, "")
	e.waitAvailable()
	hc := e.get(hcov1beta1.Name)
	if err := conditionIs(hc, hcov1beta1.ConditionDegraded, metav1.ConditionFalse, ""); err != nil {
		t.Error(err)
	}
	if err := conditionIs(hc, hcov1beta1.ConditionUpgradeable, metav1.ConditionTrue, ""); err != nil {
		t.Error(err)
	}
}

func TestAggregateKeepsEveryFailingMessage(t *testing.T) {
	s := aggregate([]componentHealth{
		{Kind: kindKubeVirt, Available: false, Message: "no nodeagent is ready"},
		{Kind: kindCDI, Available: true},
		{Kind: kindSSP, Available: false, Message: "validator down"},
	}, nil)
	av := s[hcov1beta1.ConditionAvailable]
	if av.Status != metav1.ConditionFalse || !strings.Contains(av.Message, "KubeVirt is not available: no nodeagent is ready") ||
		!strings.Contains(av.Message, "SSP is not available: validator down") {
		t.Errorf("available = %+v", av)
	}
	if s[hcov1beta1.ConditionDegraded].Status != metav1.ConditionFalse || s[hcov1beta1.ConditionUpgradeable].Status != metav1.ConditionTrue {
		t.Errorf("degraded %+v upgradeable %+v", s[hcov1beta1.ConditionDegraded], s[hcov1beta1.ConditionUpgradeable])
	}
	p := aggregate([]componentHealth{{Kind: kindCDI, Available: true, Progressing: true, Message: "rolling"}}, nil)
	if p[hcov1beta1.ConditionAvailable].Status != metav1.ConditionTrue || p[hcov1beta1.ConditionUpgradeable].Status != metav1.ConditionFalse ||
		p[hcov1beta1.ConditionProgressing].Reason != "CDIProgressing" {
		t.Errorf("progressing aggregation = %+v", p)
	}
}

func TestUninstallStrategies(t *testing.T) {
	e := newEnv(t)
	e.node("node-a", true, "")
	e.create(hcov1beta1.Name, "")
	e.waitAvailable()
	ctx := context.Background()
	work := e.ns
	dv := &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Name: "disk", Namespace: work},
		Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}}}}
	if _, err := e.virt.DataVolumes.Create(ctx, dv); err != nil {
		t.Fatal(err)
	}

	// Block: the deletion waits while the DataVolume exists and says why.
	if err := e.virt.HyperConvergeds.Delete(ctx, e.ns, hcov1beta1.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, wait, "the expected state", func() error {
		hc := e.get(hcov1beta1.Name)
		return conditionIs(hc, hcov1beta1.ConditionReconcileComplete, metav1.ConditionFalse, "DataVolumes present")
	})
	if _, err := e.virt.KubeVirts.Get(ctx, e.ns, KubeVirtName); err != nil {
		t.Errorf("kubevirt removed while uninstall is blocked: %v", err)
	}

	// Switching to RemoveWorkloads lets it through and removes the workloads and children.
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.UninstallStrategy = hcov1beta1.RemoveWorkloads })
	testkit.Eventually(t, wait, "the expected state", func() error {
		if _, err := e.virt.HyperConvergeds.Get(ctx, e.ns, hcov1beta1.Name); !apierrors.IsNotFound(err) {
			return fmt.Errorf("hyperconverged still there: %v", err)
		}
		if _, err := e.virt.DataVolumes.Get(ctx, work, "disk"); !apierrors.IsNotFound(err) {
			return fmt.Errorf("datavolume still there: %v", err)
		}
		if _, err := e.virt.CDIs.Get(ctx, "", CDIName); !apierrors.IsNotFound(err) {
			return fmt.Errorf("cdi still there: %v", err)
		}
		if _, err := e.virt.NetworkAddonsConfigs.Get(ctx, "", CNAOName); !apierrors.IsNotFound(err) {
			return fmt.Errorf("network addons still there: %v", err)
		}
		return nil
	})
}
