package hco

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// A HyperConverged written as upstream's documentation writes one: each
// setting must show up in the child that carries it.
const documentedCR = `{
  "metadata": {"annotations": {"nodevirt.io/use-emulation": "true"}},
  "spec": {
    "featureGates": {"downwardMetrics": true, "declarativeHotplugVolumes": false},
    "liveMigrationConfig": {"parallelMigrationsPerCluster": 3, "bandwidthPerMigration": "64Mi", "completionTimeoutPerGiB": 100},
    "certConfig": {"ca": {"duration": "72h0m0s", "renewBefore": "36h0m0s"}, "server": {"duration": "36h0m0s", "renewBefore": "18h0m0s"}},
    "workloadUpdateStrategy": {"workloadUpdateMethods": ["LiveMigrate", "Evict"], "batchEvictionSize": 5},
    "uninstallStrategy": "RemoveWorkloads",
    "kubeMacPoolConfiguration": {"rangeStart": "02:aa:00:00:00:00", "rangeEnd": "02:aa:00:00:ff:ff"},
    "storageImport": {"insecureRegistries": ["registry.lab:5000"]},
    "resourceRequirements": {"vmiCPUAllocationRatio": 4},
    "obsoleteCPUs": {"cpuModels": ["Penryn"], "minCPUModel": "Haswell"},
    "defaultCPUModel": "host-model",
    "tlsSecurityProfile": {"type": "Modern", "modern": {}},
    "commonTemplatesNamespace": "templates",
    "workloads": {"nodePlacement": {"nodeSelector": {"role": "virt"}}},
    "storagePools": [{"name": "local", "path": "/var/lib/nodevirt/pools/local"}]
  }
}`

func TestDocumentedFieldsReachTheirChildren(t *testing.T) {
	e := newEnv(t)
	e.node("node-a", true, "")
	e.servePools("node-a", map[string]string{"role": "virt"}, "local")
	e.create(hcov1beta1.Name, documentedCR)
	hc := e.waitAvailable()
	if len(hc.Status.RelatedObjects) != 5 {
		t.Errorf("relatedObjects = %d, want 5 with the HostPathProvisioner", len(hc.Status.RelatedObjects))
	}
	ctx := context.Background()
	kv, err := e.virt.KubeVirts.Get(ctx, e.ns, KubeVirtName)
	if err != nil {
		t.Fatal(err)
	}
	c := kv.Spec.Configuration
	gates := c.DeveloperConfiguration.FeatureGates
	if !c.DeveloperConfiguration.UseEmulation {
		t.Error("use-emulation annotation did not reach developerConfiguration.useEmulation")
	}
	// downwardMetrics is asked for but not implemented: no gate says
	// otherwise. declarativeHotplugVolumes false asks for the older
	// HotplugVolumes gate.
	if slices.Contains(gates, "HypervStrictCheck") || slices.Contains(gates, "DownwardMetrics") ||
		!slices.Contains(gates, "HotplugVolumes") || slices.Contains(gates, "DeclarativeHotplugVolumes") {
		t.Errorf("feature gates = %v", gates)
	}
	if *c.MigrationConfiguration.ParallelMigrationsPerCluster != 3 || c.MigrationConfiguration.BandwidthPerMigration.String() != "64Mi" ||
		*c.MigrationConfiguration.CompletionTimeoutPerGiB != 100 {
		t.Errorf("migrations = %+v", c.MigrationConfiguration)
	}
	if kv.Spec.CertificateRotationStrategy.SelfSigned.CA.Duration.Duration != 72*time.Hour {
		t.Errorf("cert rotation = %+v", kv.Spec.CertificateRotationStrategy.SelfSigned.CA)
	}
	if len(kv.Spec.WorkloadUpdateStrategy.WorkloadUpdateMethods) != 2 || *kv.Spec.WorkloadUpdateStrategy.BatchEvictionSize != 5 {
		t.Errorf("workload update strategy = %+v", kv.Spec.WorkloadUpdateStrategy)
	}
	if kv.Spec.UninstallStrategy != kubevirtv1.KubeVirtUninstallStrategyRemoveWorkloads {
		t.Errorf("uninstall = %q", kv.Spec.UninstallStrategy)
	}
	if c.DeveloperConfiguration.CPUAllocationRatio != 4 || c.CPUModel != "host-model" || !c.ObsoleteCPUModels["Penryn"] ||
		!c.ObsoleteCPUModels["qemu64"] || c.DeprecatedMinCPUModel != "Haswell" {
		t.Errorf("cpu settings = ratio %d model %q obsolete %v min %q", c.DeveloperConfiguration.CPUAllocationRatio,
			c.CPUModel, c.ObsoleteCPUModels, c.DeprecatedMinCPUModel)
	}
	if c.TLSConfiguration.MinTLSVersion != kubevirtv1.VersionTLS13 {
		t.Errorf("tls = %+v", c.TLSConfiguration)
	}
	if kv.Spec.Workloads == nil || kv.Spec.Workloads.NodePlacement.NodeSelector["role"] != "virt" {
		t.Errorf("workloads placement = %+v", kv.Spec.Workloads)
	}

	cdi, err := e.virt.CDIs.Get(ctx, "", CDIName)
	if err != nil {
		t.Fatal(err)
	}
	if string(*cdi.Spec.UninstallStrategy) != "RemoveWorkloads" || !slices.Equal(cdi.Spec.Config.InsecureRegistries, []string{"registry.lab:5000"}) ||
		cdi.Spec.CertConfig.Server.Duration.Duration != 36*time.Hour || cdi.Spec.Config.TLSSecurityProfile.Modern == nil ||
		cdi.Spec.Workloads.NodeSelector["role"] != "virt" {
		t.Errorf("cdi spec = %+v / config %+v", cdi.Spec, cdi.Spec.Config)
	}
	nac, err := e.virt.NetworkAddonsConfigs.Get(ctx, "", CNAOName)
	if err != nil {
		t.Fatal(err)
	}
	if nac.Spec.KubeMacPool.RangeStart != "02:aa:00:00:00:00" || nac.Spec.KubeMacPool.RangeEnd != "02:aa:00:00:ff:ff" {
		t.Errorf("mac pool = %+v", nac.Spec.KubeMacPool)
	}
	ssp, err := e.virt.SSPs.Get(ctx, e.ns, SSPName)
	if err != nil {
		t.Fatal(err)
	}
	if ssp.Spec.CommonTemplates.Namespace != "templates" {
		t.Errorf("ssp templates namespace = %q", ssp.Spec.CommonTemplates.Namespace)
	}
	hpp, err := e.virt.HostPathProvisioners.Get(ctx, "", HPPName)
	if err != nil {
		t.Fatal(err)
	}
	if len(hpp.Spec.StoragePools) != 1 || hpp.Spec.StoragePools[0].Path != "/var/lib/nodevirt/pools/local" ||
		hpp.Spec.Workload.NodeSelector["role"] != "virt" || hpp.Status.Phase != phaseDeployed {
		t.Errorf("hpp = %+v", hpp)
	}
	if ps := hpp.Status.StoragePoolStatuses; len(ps) != 1 || ps[0].Name != "local" || ps[0].CurrentReady != 1 || ps[0].DesiredReady != 1 {
		t.Errorf("hpp pool status = %+v", ps)
	}
	// The node stops serving the pool: the HPP child, and the platform,
	// say which node and pool.
	e.servePools("node-a", nil)
	testkit.Eventually(t, wait, "the HPP child follows its pools", func() error {
		return conditionIs(e.get(hcov1beta1.Name), hcov1beta1.ConditionAvailable, metav1.ConditionFalse,
			"HostPathProvisioner is not available: HostPathProvisioner hostpath-provisioner: a storage pool is served by no node")
	})
	e.servePools("node-a", nil, "local")
	e.waitAvailable()

	// Changes follow: a new MAC range, emulation off, pools removed.
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) {
		hc.Spec.KubeMacPoolConfiguration.RangeStart = ptrTo("02:bb:00:00:00:00")
		hc.Spec.KubeMacPoolConfiguration.RangeEnd = ptrTo("02:bb:00:00:ff:ff")
		delete(hc.Annotations, hcov1beta1.UseEmulationAnnotation)
		hc.Spec.StoragePools = nil
	})
	testkit.Eventually(t, wait, "the expected state", func() error {
		nac, err := e.virt.NetworkAddonsConfigs.Get(ctx, "", CNAOName)
		if err != nil {
			return err
		}
		if nac.Spec.KubeMacPool.RangeStart != "02:bb:00:00:00:00" {
			return fmt.Errorf("mac range start %q", nac.Spec.KubeMacPool.RangeStart)
		}
		kv, err := e.virt.KubeVirts.Get(ctx, e.ns, KubeVirtName)
		if err != nil {
			return err
		}
		if kv.Spec.Configuration.DeveloperConfiguration.UseEmulation {
			return errors.New("emulation still on")
		}
		if _, err := e.virt.HostPathProvisioners.Get(ctx, "", HPPName); err == nil {
			return errors.New("hostpath provisioner still there without pools")
		}
		return nil
	})
	if got := e.ctrl.Reverts(); len(got) != 0 {
		t.Errorf("HCO-driven updates counted as reverts: %v", got)
	}
}

func TestManualEditsOfChildrenAreReverted(t *testing.T) {
	e := newEnv(t)
	e.node("node-a", true, "")
	e.create(hcov1beta1.Name, "")
	e.waitAvailable()
	ctx := context.Background()

	start := time.Now()
	patch := `{"spec":{"configuration":{"developerConfiguration":{"featureGates":["Sidecar"],"useEmulation":true}}}}`
	if _, err := e.virt.KubeVirts.Patch(ctx, e.ns, KubeVirtName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, wait, "the expected state", func() error {
		kv, err := e.virt.KubeVirts.Get(ctx, e.ns, KubeVirtName)
		if err != nil {
			return err
		}
		dc := kv.Spec.Configuration.DeveloperConfiguration
		if slices.Contains(dc.FeatureGates, "Sidecar") || dc.UseEmulation {
			return fmt.Errorf("kubevirt still edited: %+v", dc)
		}
		return nil
	})
	t.Logf("KubeVirt edit reverted in %v", time.Since(start).Round(time.Millisecond))

	mac := `{"spec":{"kubeMacPool":{"rangeStart":"02:00:00:00:00:00","rangeEnd":"02:00:00:00:00:01"}}}`
	if _, err := e.virt.NetworkAddonsConfigs.Patch(ctx, "", CNAOName, types.MergePatchType, []byte(mac), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	label := `{"metadata":{"labels":{"app":"someone-else"}}}`
	if _, err := e.virt.CDIs.Patch(ctx, "", CDIName, types.MergePatchType, []byte(label), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, wait, "the expected state", func() error {
		nac, err := e.virt.NetworkAddonsConfigs.Get(ctx, "", CNAOName)
		if err != nil {
			return err
		}
		if nac.Spec.KubeMacPool.RangeEnd == "02:00:00:00:00:01" {
			return errors.New("mac pool edit not reverted")
		}
		cdi, err := e.virt.CDIs.Get(ctx, "", CDIName)
		if err != nil {
			return err
		}
		if cdi.Labels[LabelApp] != hcov1beta1.Name {
			return errors.New("cdi label edit not reverted")
		}
		return nil
	})
	// A deleted child comes back.
	if err := e.virt.SSPs.Delete(ctx, e.ns, SSPName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, wait, "the expected state", func() error {
		_, err := e.virt.SSPs.Get(ctx, e.ns, SSPName)
		return err
	})

	r := e.ctrl.Reverts()
	if r[kindKubeVirt] != 1 || r[kindCNAO] != 1 || r[kindCDI] != 1 {
		t.Errorf("reverts = %v, want one each for KubeVirt, NetworkAddonsConfig, CDI", r)
	}
	// The brain's /metrics serves the count under upstream HCO's name.
	rec := httptest.NewRecorder()
	metrics.Default().Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	for _, want := range []string{`kubevirt_hco_out_of_band_modifications_total{component_name="KubeVirt"}`,
		`nodevirt_reconcile_total{controller="hyperconverged",result="ok"}`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	testkit.Eventually(t, wait, "the expected state", func() error {
		evs, err := e.kube.CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=Overwritten"})
		if err != nil {
			return err
		}
		for _, ev := range evs.Items {
			if strings.Contains(ev.Message, "KubeVirt "+KubeVirtName) && ev.InvolvedObject.Kind == "HyperConverged" {
				return nil
			}
		}
		return fmt.Errorf("no Overwritten event for the KubeVirt among %d", len(evs.Items))
	})
}

func TestJSONPatchAnnotationsTaintTheConfiguration(t *testing.T) {
	e := newEnv(t)
	e.node("node-a", true, "")
	e.create(hcov1beta1.Name, `{"metadata":{"annotations":{
		"kubevirt.kubevirt.io/jsonpatch": "[{\"op\":\"add\",\"path\":\"/spec/configuration/developerConfiguration/featureGates/-\",\"value\":\"Sidecar\"},{\"op\":\"add\",\"path\":\"/spec/configuration/machineType\",\"value\":\"pc-q35-9.2\"}]",
		"networkaddonsconfigs.kubevirt.io/jsonpatch": "[{\"op\":\"replace\",\"path\":\"/spec/kubeMacPool/rangeStart\",\"value\":\"02:cc:00:00:00:00\"}]"}}}`)
	hc := e.waitAvailable()
	c := condition(hc, hcov1beta1.ConditionTaintedConfiguration)
	if c == nil || c.Status != metav1.ConditionTrue || c.Reason != reasonTainted {
		t.Fatalf("tainted condition = %+v", c)
	}
	ctx := context.Background()
	kv, err := e.virt.KubeVirts.Get(ctx, e.ns, KubeVirtName)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(kv.Spec.Configuration.DeveloperConfiguration.FeatureGates, "Sidecar") || kv.Spec.Configuration.MachineType != "pc-q35-9.2" {
		t.Errorf("kubevirt patch not applied: gates %v machine %q", kv.Spec.Configuration.DeveloperConfiguration.FeatureGates, kv.Spec.Configuration.MachineType)
	}
	nac, err := e.virt.NetworkAddonsConfigs.Get(ctx, "", CNAOName)
	if err != nil {
		t.Fatal(err)
	}
	if nac.Spec.KubeMacPool.RangeStart != "02:cc:00:00:00:00" {
		t.Errorf("cnao patch not applied: %+v", nac.Spec.KubeMacPool)
	}

	// Dropping the annotations removes the condition and the overrides.
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) {
		delete(hc.Annotations, hcov1beta1.JSONPatchKubeVirtAnnotation)
		delete(hc.Annotations, hcov1beta1.JSONPatchCNAOAnnotation)
	})
	testkit.Eventually(t, wait, "the expected state", func() error {
		hc := e.get(hcov1beta1.Name)
		if condition(hc, hcov1beta1.ConditionTaintedConfiguration) != nil {
			return errors.New("still tainted")
		}
		kv, err := e.virt.KubeVirts.Get(ctx, e.ns, KubeVirtName)
		if err != nil {
			return err
		}
		if kv.Spec.Configuration.MachineType != "" {
			return errors.New("patched machine type stays")
		}
		return nil
	})

	// A patch that cannot apply fails the reconcile with upstream's message.
	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) {
		hc.Annotations = map[string]string{hcov1beta1.JSONPatchSSPAnnotation: `[{"op":"replace","path":"/spec/nothing/here","value":1}]`}
	})
	testkit.Eventually(t, wait, "the expected state", func() error {
		hc := e.get(hcov1beta1.Name)
		c := condition(hc, hcov1beta1.ConditionReconcileComplete)
		if c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "invalid jsonPatch in the ssp.kubevirt.io/jsonpatch annotation") {
			return fmt.Errorf("reconcile complete = %+v", c)
		}
		return nil
	})
}
