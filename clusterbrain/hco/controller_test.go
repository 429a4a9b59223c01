package hco

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/test/testkit"
)

const wait = 20 * time.Second

func availableErr(hc *hcov1beta1.HyperConverged) error {
	c := condition(hc, hcov1beta1.ConditionAvailable)
	if c == nil || c.Status != metav1.ConditionTrue {
		return fmt.Errorf("not available: %+v", hc.Status.Conditions)
	}
	if hc.Status.ObservedGeneration != hc.Generation {
		return fmt.Errorf("observed generation %d, generation %d", hc.Status.ObservedGeneration, hc.Generation)
	}
	return nil
}

func (e *env) waitAvailable() *hcov1beta1.HyperConverged {
	e.t.Helper()
	var hc *hcov1beta1.HyperConverged
	testkit.Eventually(e.t, wait, "the expected state", func() error {
		hc = e.get(hcov1beta1.Name)
		return availableErr(hc)
	})
	return hc
}

func TestEmptyCRGetsUpstreamDefaultsAndEveryChild(t *testing.T) {
	e := newEnv(t)
	e.node("node-a", true, "")
	start := time.Now()
	e.create(hcov1beta1.Name, "")
	hc := e.waitAvailable()
	t.Logf("empty HyperConverged to Available in %v", time.Since(start).Round(time.Millisecond))

	s := hc.Spec
	if s.UninstallStrategy != hcov1beta1.BlockUninstallIfWorkloadsExist {
		t.Errorf("uninstallStrategy = %q", s.UninstallStrategy)
	}
	if s.CertConfig.CA.Duration.Duration != 48*time.Hour || s.CertConfig.Server.RenewBefore.Duration != 12*time.Hour {
		t.Errorf("certConfig = %+v", s.CertConfig)
	}
	if *s.LiveMigrationConfig.ParallelMigrationsPerCluster != 5 || *s.LiveMigrationConfig.ProgressTimeout != 150 {
		t.Errorf("liveMigrationConfig = %+v", s.LiveMigrationConfig)
	}
	if !*s.FeatureGates.DecentralizedLiveMigration || *s.FeatureGates.DownwardMetrics {
		t.Errorf("featureGates = %+v", s.FeatureGates)
	}
	if !slices.Equal(s.WorkloadUpdateStrategy.WorkloadUpdateMethods, []string{"LiveMigrate"}) || *s.WorkloadUpdateStrategy.BatchEvictionSize != 10 {
		t.Errorf("workloadUpdateStrategy = %+v", s.WorkloadUpdateStrategy)
	}
	if !slices.Contains(hc.Finalizers, Finalizer) {
		t.Errorf("finalizers = %v", hc.Finalizers)
	}
	if len(hc.Status.Versions) != 1 || hc.Status.Versions[0].Version != "v1.2.3" {
		t.Errorf("versions = %+v", hc.Status.Versions)
	}
	if len(hc.Status.RelatedObjects) != 4 {
		t.Errorf("relatedObjects = %+v", hc.Status.RelatedObjects)
	}
	for _, typ := range hcoConditionTypes {
		if condition(hc, typ) == nil {
			t.Errorf("condition %s missing", typ)
		}
	}
	if c := condition(hc, hcov1beta1.ConditionTaintedConfiguration); c != nil {
		t.Errorf("tainted without annotations: %+v", c)
	}

	ctx := context.Background()
	kv, err := e.virt.KubeVirts.Get(ctx, e.ns, KubeVirtName)
	if err != nil {
		t.Fatal(err)
	}
	if ref := metav1.GetControllerOf(kv); ref == nil || ref.UID != hc.UID {
		t.Errorf("kubevirt owner = %+v", kv.OwnerReferences)
	}
	gates := kv.Spec.Configuration.DeveloperConfiguration.FeatureGates
	// Upstream's defaults ask for these; nodevirt implements none of them,
	// so the KubeVirt CR does not advertise them.
	for _, g := range []string{"CPUManager", "Snapshot", "HostDevices", "HypervStrictCheck", "DecentralizedLiveMigration",
		"HotplugVolumes", "KubevirtSeccompProfile", featuregate.HostDisk} {
		if slices.Contains(gates, g) {
			t.Errorf("kubevirt feature gates %v advertise %s", gates, g)
		}
	}
	// HCO's default declarativeHotplugVolumes: true, which nodevirt acts on.
	if !slices.Contains(gates, featuregate.DeclarativeHotplugVolumes) {
		t.Errorf("kubevirt feature gates %v lack %s", gates, featuregate.DeclarativeHotplugVolumes)
	}
	if kv.Spec.UninstallStrategy != kubevirtv1.KubeVirtUninstallStrategyBlockUninstallIfWorkloadsExist {
		t.Errorf("kubevirt uninstallStrategy = %q", kv.Spec.UninstallStrategy)
	}
	if kv.Spec.Configuration.DeveloperConfiguration.UseEmulation {
		t.Error("emulation on without the annotation")
	}
	if kv.Status.Phase != kubevirtv1.KubeVirtPhaseDeployed || len(kv.Status.Conditions) != 3 {
		t.Errorf("kubevirt status = %+v", kv.Status)
	}
	if tc := kv.Spec.Configuration.TLSConfiguration; tc == nil || tc.MinTLSVersion != kubevirtv1.VersionTLS12 || len(tc.Ciphers) == 0 {
		t.Errorf("kubevirt tls = %+v", tc)
	}

	cdi, err := e.virt.CDIs.Get(ctx, "", CDIName)
	if err != nil {
		t.Fatal(err)
	}
	if cdi.Labels[LabelOwnerNamespace] != e.ns || len(cdi.OwnerReferences) != 0 {
		t.Errorf("cdi labels %v owners %v", cdi.Labels, cdi.OwnerReferences)
	}
	if !slices.Equal(cdi.Spec.Config.FeatureGates, []string{featuregate.HonorWaitForFirstConsumer}) {
		t.Errorf("cdi feature gates = %v", cdi.Spec.Config.FeatureGates)
	}
	if cdi.Status.Phase != "Deployed" {
		t.Errorf("cdi phase = %q", cdi.Status.Phase)
	}

	nac, err := e.virt.NetworkAddonsConfigs.Get(ctx, "", CNAOName)
	if err != nil {
		t.Fatal(err)
	}
	if nac.Spec.LinuxBridge == nil || nac.Spec.Multus == nil || nac.Spec.KubeMacPool == nil ||
		!strings.HasPrefix(nac.Spec.KubeMacPool.RangeStart, "02:") || !strings.HasSuffix(nac.Spec.KubeMacPool.RangeEnd, ":ff:ff:ff") {
		t.Errorf("network addons spec = %+v", nac.Spec)
	}
	if nac.Spec.SelfSignConfiguration.CARotateInterval != "48h0m0s" {
		t.Errorf("selfSignConfiguration = %+v", nac.Spec.SelfSignConfiguration)
	}

	ssp, err := e.virt.SSPs.Get(ctx, e.ns, SSPName)
	if err != nil {
		t.Fatal(err)
	}
	if ssp.Spec.CommonTemplates.Namespace != "openshift" || *ssp.Spec.TemplateValidator.Replicas != 2 {
		t.Errorf("ssp spec = %+v", ssp.Spec)
	}
	if _, err := e.virt.HostPathProvisioners.Get(ctx, "", HPPName); !apierrors.IsNotFound(err) {
		t.Errorf("hostpath provisioner without storage pools: %v", err)
	}
}

func TestOtherNamesAreRefusedWithACondition(t *testing.T) {
	e := newEnv(t)
	e.node("node-a", true, "")
	e.create("my-hco", "")
	testkit.Eventually(t, wait, "the expected state", func() error {
		hc := e.get("my-hco")
		c := condition(hc, hcov1beta1.ConditionReconcileComplete)
		if c == nil || c.Status != metav1.ConditionFalse || c.Reason != reasonInvalidRequest {
			return fmt.Errorf("conditions %+v", hc.Status.Conditions)
		}
		if !strings.Contains(c.Message, "kubevirt-hyperconverged") {
			return errors.New("message does not name the expected name: " + c.Message)
		}
		return nil
	})
	if _, err := e.virt.KubeVirts.Get(context.Background(), e.ns, KubeVirtName); !apierrors.IsNotFound(err) {
		t.Errorf("kubevirt rendered for a refused HyperConverged: %v", err)
	}
}
