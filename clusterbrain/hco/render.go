package hco

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"maps"
	"slices"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
	sdkapi "kubevirt.io/controller-lifecycle-operator-sdk/api"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	cnaov1 "github.com/nodevirt/nodevirt/clusterbrain/api/networkaddons/v1"
	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
)

// Upstream's names of the children.
const (
	KubeVirtName = "kubevirt-" + hcov1beta1.Name
	CDIName      = "cdi-" + hcov1beta1.Name
	CNAOName     = cnaov1.Name
	SSPName      = "ssp-" + hcov1beta1.Name
	HPPName      = "hostpath-provisioner"
)

// Labels every child carries (upstream's recommended labels), plus the
// owner label that stands in for an ownerReference on cluster-scoped ones.
const (
	LabelApp       = "app"
	LabelManagedBy = "app.kubernetes.io/managed-by"
	LabelPartOf    = "app.kubernetes.io/part-of"
	LabelComponent = "app.kubernetes.io/component"
	LabelVersion   = "app.kubernetes.io/version"
	// LabelOwnerNamespace names the namespace of the owning HyperConverged
	// on children that cannot carry an ownerReference to it.
	LabelOwnerNamespace = "hco.kubevirt.io/owner-namespace"
	// ManagedBy is the value of LabelManagedBy on every child.
	ManagedBy = "nodevirt-clusterbrain"
	partOf    = "hyperconverged-cluster"

	cdiConfigAuthorityAnnotation = "cdi.kubevirt.io/configAuthority"
	defaultTemplatesNamespace    = "openshift"
	defaultValidatorReplicas     = int32(2)
)

// Feature gates upstream HCO always sets on KubeVirt; HypervStrictCheck is
// added unless the platform emulates. None of them is implemented by
// nodevirt, so kubeVirtGates filters them out (featuregate).
var (
	mandatoryKubeVirtGates = []string{"CPUManager", "Snapshot", "HostDevices", "KubevirtSeccompProfile"}
	hardwareKubeVirtGates  = []string{"HypervStrictCheck"}
	// cdiGates are the gates upstream HCO sets on CDI.
	cdiGates          = []string{"HonorWaitForFirstConsumer", "DataVolumeClaimAdoption"}
	obsoleteCPUModels = []string{"486", "pentium", "pentium2", "pentium3", "pentiumpro", "coreduo", "n270",
		"core2duo", "Conroe", "athlon", "phenom", "qemu64", "qemu32", "kvm64", "kvm32"}
	diskVerificationLimit = resource.MustParse("2G")
)

// Children are the component CRs rendered from one HyperConverged.
type Children struct {
	KubeVirt *kubevirtv1.KubeVirt
	CDI      *cdiv1.CDI
	CNAO     *cnaov1.NetworkAddonsConfig
	SSP      *sspv1beta2.SSP
	// HPP is nil unless spec.storagePools is set.
	HPP *hppv1beta1.HostPathProvisioner
}

// Render builds every child from a defaulted HyperConverged, applying the
// emulation convenience annotation and the JSON-patch annotations. version
// goes into the children's version label and KubeVirt's productVersion.
func Render(hc *hcov1beta1.HyperConverged, version string) (*Children, error) {
	var c Children
	var err error
	if c.KubeVirt, err = renderKubeVirt(hc, version); err != nil {
		return nil, err
	}
	if c.CDI, err = renderCDI(hc, version); err != nil {
		return nil, err
	}
	if c.CNAO, err = renderCNAO(hc, version); err != nil {
		return nil, err
	}
	if c.SSP, err = renderSSP(hc, version); err != nil {
		return nil, err
	}
	c.HPP = renderHPP(hc, version)
	return &c, nil
}

func labels(hc *hcov1beta1.HyperConverged, component, version string, clusterScoped bool) map[string]string {
	l := map[string]string{
		LabelApp: hc.Name, LabelManagedBy: ManagedBy, LabelPartOf: partOf,
		LabelComponent: component, LabelVersion: version,
	}
	if clusterScoped {
		l[LabelOwnerNamespace] = hc.Namespace
	}
	return l
}

func ownedMeta(hc *hcov1beta1.HyperConverged, name, component, version string) metav1.ObjectMeta {
	yes := true
	return metav1.ObjectMeta{
		Name: name, Namespace: hc.Namespace, Labels: labels(hc, component, version, false),
		OwnerReferences: []metav1.OwnerReference{{
			APIVersion: hcov1beta1.SchemeGroupVersion.String(), Kind: "HyperConverged",
			Name: hc.Name, UID: hc.UID, Controller: &yes, BlockOwnerDeletion: &yes,
		}},
	}
}

// UsesEmulation reports whether the HyperConverged asks KubeVirt to emulate.
func UsesEmulation(hc *hcov1beta1.HyperConverged) bool {
	return hc.Annotations[hcov1beta1.UseEmulationAnnotation] == "true"
}

func kubeVirtGates(hc *hcov1beta1.HyperConverged) []string {
	fg := hc.Spec.FeatureGates
	on := func(p *bool) bool { return p != nil && *p }
	gates := slices.Clone(mandatoryKubeVirtGates)
	if !UsesEmulation(hc) {
		gates = append(gates, hardwareKubeVirtGates...)
	}
	add := func(cond bool, names ...string) {
		if cond {
			gates = append(gates, names...)
		}
	}
	add(on(fg.DownwardMetrics), "DownwardMetrics")
	add(on(fg.AlignCPUs), "AlignCPUs")
	add(on(fg.ObjectGraph), "ObjectGraph")
	add(on(fg.DecentralizedLiveMigration), "DecentralizedLiveMigration")
	if on(fg.DeclarativeHotplugVolumes) {
		gates = append(gates, "DeclarativeHotplugVolumes")
	} else {
		gates = append(gates, "HotplugVolumes")
	}
	add(on(fg.IncrementalBackup), "IncrementalBackup", "UtilityVolumes")
	add(on(fg.ContainerPathVolumes), "ContainerPathVolumes")
	add(on(fg.PersistentReservation), "PersistentReservation")
	add(on(fg.DisableMDevConfiguration), "DisableMDEVConfiguration")
	add(on(fg.VideoConfig), "VideoConfig")
	add(on(fg.AutoResourceLimits), "AutoResourceLimitsGate")
	add(fg.NonRoot != nil && !*fg.NonRoot, "Root")
	add(on(fg.WithHostPassthroughCPU), "WithHostPassthroughCPU")
	// Upstream's mapping above says what each HCO field asks of KubeVirt;
	// the KubeVirt CR advertises only the gates nodevirt implements.
	return featuregate.Implemented(gates, featuregate.KubeVirtImplemented)
}

func kubeVirtPlacement(c hcov1beta1.HyperConvergedConfig) *kubevirtv1.ComponentConfig {
	if c.NodePlacement == nil {
		return nil
	}
	np := c.NodePlacement
	return &kubevirtv1.ComponentConfig{NodePlacement: &kubevirtv1.NodePlacement{
		NodeSelector: maps.Clone(np.NodeSelector), Affinity: np.Affinity.DeepCopy(), Tolerations: slices.Clone(np.Tolerations),
	}}
}

func renderKubeVirt(hc *hcov1beta1.HyperConverged, version string) (*kubevirtv1.KubeVirt, error) {
	s := &hc.Spec
	dev := &kubevirtv1.DeveloperConfiguration{
		FeatureGates:     kubeVirtGates(hc),
		DiskVerification: &kubevirtv1.DiskVerification{MemoryLimit: ptrTo(diskVerificationLimit.DeepCopy())},
		UseEmulation:     UsesEmulation(hc),
	}
	if s.HigherWorkloadDensity != nil {
		dev.MemoryOvercommit = s.HigherWorkloadDensity.MemoryOvercommitPercentage
	}
	if s.LogVerbosityConfig != nil && s.LogVerbosityConfig.Kubevirt != nil {
		dev.LogVerbosity = s.LogVerbosityConfig.Kubevirt.DeepCopy()
	}
	if s.ResourceRequirements != nil && s.ResourceRequirements.VmiCPUAllocationRatio != nil {
		dev.CPUAllocationRatio = *s.ResourceRequirements.VmiCPUAllocationRatio
	}

	lm := s.LiveMigrationConfig
	mig := &kubevirtv1.MigrationConfiguration{
		CompletionTimeoutPerGiB: lm.CompletionTimeoutPerGiB, ParallelOutboundMigrationsPerNode: lm.ParallelOutboundMigrationsPerNode,
		ParallelMigrationsPerCluster: lm.ParallelMigrationsPerCluster, ProgressTimeout: lm.ProgressTimeout,
		Network: lm.Network, AllowAutoConverge: lm.AllowAutoConverge, AllowPostCopy: lm.AllowPostCopy,
	}
	if lm.BandwidthPerMigration != nil {
		q, err := resource.ParseQuantity(*lm.BandwidthPerMigration)
		if err != nil {
			return nil, fmt.Errorf("failed to parse the LiveMigrationConfig.bandwidthPerMigration field; %w", err)
		}
		mig.BandwidthPerMigration = &q
	}

	obsolete := map[string]bool{}
	minCPU := ""
	for _, m := range obsoleteCPUModels {
		obsolete[m] = true
	}
	if s.ObsoleteCPUs != nil {
		for _, m := range s.ObsoleteCPUs.CPUModels {
			obsolete[m] = true
		}
		minCPU = s.ObsoleteCPUs.MinCPUModel
	}

	tlsSpec := profileSpecOf(s.TLSSecurityProfile)
	minTLS := kubevirtv1.TLSProtocolVersion(tlsSpec.MinTLSVersion)
	if _, ok := tlsprofile.Versions[tlsSpec.MinTLSVersion]; !ok {
		minTLS = kubevirtv1.VersionTLS12
	}

	cfg := kubevirtv1.KubeVirtConfiguration{
		DeveloperConfiguration: dev,
		NetworkConfiguration: &kubevirtv1.NetworkConfiguration{
			NetworkInterface: string(kubevirtv1.MasqueradeInterface), Binding: s.NetworkBinding,
		},
		MigrationConfiguration:        mig,
		PermittedHostDevices:          s.PermittedHostDevices.DeepCopy(),
		ObsoleteCPUModels:             obsolete,
		DeprecatedMinCPUModel:         minCPU,
		TLSConfiguration:              &kubevirtv1.TLSConfiguration{MinTLSVersion: minTLS, Ciphers: tlsprofile.IANACiphers(tlsSpec.Ciphers)},
		EvictionStrategy:              s.EvictionStrategy,
		KSMConfiguration:              s.KSMConfiguration.DeepCopy(),
		CommonInstancetypesDeployment: s.CommonInstancetypesDeployment.DeepCopy(),
		Instancetype:                  s.InstancetypeConfig.DeepCopy(),
		// HCO always asks for LiveUpdate (KubeVirt's default since v1.6);
		// the kubevirt.kubevirt.io/jsonpatch annotation can set Stage.
		VMRolloutStrategy:       ptrTo(kubevirtv1.VMRolloutStrategyLiveUpdate),
		LiveUpdateConfiguration: s.LiveUpdateConfiguration.DeepCopy(),
	}
	if s.DefaultCPUModel != nil {
		cfg.CPUModel = *s.DefaultCPUModel
	}
	if s.DefaultRuntimeClass != nil {
		cfg.DefaultRuntimeClass = *s.DefaultRuntimeClass
	}
	if s.VMStateStorageClass != nil {
		cfg.VMStateStorageClass = *s.VMStateStorageClass
	}
	if vo := s.VirtualMachineOptions; vo != nil {
		if vo.DisableFreePageReporting != nil && *vo.DisableFreePageReporting {
			cfg.VirtualMachineOptions = &kubevirtv1.VirtualMachineOptions{DisableFreePageReporting: &kubevirtv1.DisableFreePageReporting{}}
		}
		if vo.DisableSerialConsoleLog != nil && *vo.DisableSerialConsoleLog {
			if cfg.VirtualMachineOptions == nil {
				cfg.VirtualMachineOptions = &kubevirtv1.VirtualMachineOptions{}
			}
			cfg.VirtualMachineOptions.DisableSerialConsoleLog = &kubevirtv1.DisableSerialConsoleLog{}
		}
	}
	if s.ResourceRequirements != nil {
		cfg.AutoCPULimitNamespaceLabelSelector = s.ResourceRequirements.AutoCPULimitNamespaceLabelSelector.DeepCopy()
	}

	uninstall := kubevirtv1.KubeVirtUninstallStrategyBlockUninstallIfWorkloadsExist
	if s.UninstallStrategy == hcov1beta1.RemoveWorkloads {
		uninstall = kubevirtv1.KubeVirtUninstallStrategyRemoveWorkloads
	}
	wus := kubevirtv1.KubeVirtWorkloadUpdateStrategy{
		BatchEvictionSize: s.WorkloadUpdateStrategy.BatchEvictionSize, BatchEvictionInterval: s.WorkloadUpdateStrategy.BatchEvictionInterval,
	}
	for _, m := range s.WorkloadUpdateStrategy.WorkloadUpdateMethods {
		wus.WorkloadUpdateMethods = append(wus.WorkloadUpdateMethods, kubevirtv1.WorkloadUpdateMethod(m))
	}
	cc := s.CertConfig
	kv := &kubevirtv1.KubeVirt{
		TypeMeta:   metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "KubeVirt"},
		ObjectMeta: ownedMeta(hc, KubeVirtName, "compute", version),
		Spec: kubevirtv1.KubeVirtSpec{
			UninstallStrategy: uninstall,
			Infra:             kubeVirtPlacement(s.Infra),
			Workloads:         kubeVirtPlacement(s.Workloads),
			Configuration:     cfg,
			CertificateRotationStrategy: kubevirtv1.KubeVirtCertificateRotateStrategy{SelfSigned: &kubevirtv1.KubeVirtSelfSignConfiguration{
				CA:     &kubevirtv1.CertConfig{Duration: cc.CA.Duration, RenewBefore: cc.CA.RenewBefore},
				Server: &kubevirtv1.CertConfig{Duration: cc.Server.Duration, RenewBefore: cc.Server.RenewBefore},
			}},
			WorkloadUpdateStrategy: wus,
			ProductName:            partOf,
			ProductVersion:         version,
			ProductComponent:       "compute",
		},
	}
	if s.FeatureGates.AlignCPUs != nil && *s.FeatureGates.AlignCPUs {
		kv.Annotations = map[string]string{kubevirtv1.EmulatorThreadCompleteToEvenParity: ""}
	}
	gateList := []string{"spec", "configuration", "developerConfiguration", "featureGates"}
	if err := applyPatchAnnotation(hc, hcov1beta1.JSONPatchKubeVirtAnnotation, kv, gateList); err != nil {
		return nil, err
	}
	return kv, nil
}

func cdiPlacement(np *hcov1beta1.NodePlacement) sdkapi.NodePlacement {
	if np == nil {
		return sdkapi.NodePlacement{}
	}
	return sdkapi.NodePlacement{NodeSelector: maps.Clone(np.NodeSelector), Affinity: np.Affinity.DeepCopy(), Tolerations: slices.Clone(np.Tolerations)}
}

func cdiTLSProfile(p *hcov1beta1.TLSSecurityProfile) *cdiv1.TLSSecurityProfile {
	p = EffectiveTLSProfile(p)
	out := &cdiv1.TLSSecurityProfile{Type: cdiv1.TLSProfileType(p.Type)}
	switch {
	case p.Custom != nil:
		out.Custom = &cdiv1.CustomTLSProfile{TLSProfileSpec: cdiv1.TLSProfileSpec{
			Ciphers: slices.Clone(p.Custom.Ciphers), MinTLSVersion: cdiv1.TLSProtocolVersion(p.Custom.MinTLSVersion)}}
	case p.Type == TLSProfileOld:
		out.Old = &cdiv1.OldTLSProfile{}
	case p.Type == TLSProfileModern:
		out.Modern = &cdiv1.ModernTLSProfile{}
	default:
		out.Intermediate = &cdiv1.IntermediateTLSProfile{}
	}
	return out
}

func renderCDI(hc *hcov1beta1.HyperConverged, version string) (*cdiv1.CDI, error) {
	s := &hc.Spec
	uninstall := cdiv1.CDIUninstallStrategyBlockUninstallIfWorkloadsExist
	if s.UninstallStrategy == hcov1beta1.RemoveWorkloads {
		uninstall = cdiv1.CDIUninstallStrategyRemoveWorkloads
	}
	cfg := &cdiv1.CDIConfigSpec{
		FeatureGates:             featuregate.Implemented(cdiGates, featuregate.CDIImplemented),
		TLSSecurityProfile:       cdiTLSProfile(s.TLSSecurityProfile),
		ScratchSpaceStorageClass: s.ScratchSpaceStorageClass,
		FilesystemOverhead:       s.FilesystemOverhead.DeepCopy(),
	}
	if s.ResourceRequirements != nil && s.ResourceRequirements.StorageWorkloads != nil {
		cfg.PodResourceRequirements = s.ResourceRequirements.StorageWorkloads.DeepCopy()
	}
	if s.StorageImport != nil {
		cfg.InsecureRegistries = slices.Clone(s.StorageImport.InsecureRegistries)
	}
	if s.LogVerbosityConfig != nil {
		cfg.LogVerbosity = s.LogVerbosityConfig.CDI
	}
	cc := s.CertConfig
	cdi := &cdiv1.CDI{
		TypeMeta: metav1.TypeMeta{APIVersion: cdiv1.SchemeGroupVersion.String(), Kind: "CDI"},
		ObjectMeta: metav1.ObjectMeta{Name: CDIName, Labels: labels(hc, "storage", version, true),
			Annotations: map[string]string{cdiConfigAuthorityAnnotation: ""}},
		Spec: cdiv1.CDISpec{
			UninstallStrategy: &uninstall,
			Infra:             cdiv1.ComponentConfig{NodePlacement: cdiPlacement(s.Infra.NodePlacement)},
			Workloads:         cdiPlacement(s.Workloads.NodePlacement),
			Config:            cfg,
			CertConfig: &cdiv1.CDICertConfig{
				CA:     &cdiv1.CertConfig{Duration: cc.CA.Duration, RenewBefore: cc.CA.RenewBefore},
				Server: &cdiv1.CertConfig{Duration: cc.Server.Duration, RenewBefore: cc.Server.RenewBefore},
			},
		},
	}
	if v, ok := hc.Annotations[importstate.AnnImportAllowedNetworks]; ok {
		cdi.Annotations[importstate.AnnImportAllowedNetworks] = v
	}
	if err := applyPatchAnnotation(hc, hcov1beta1.JSONPatchCDIAnnotation, cdi, []string{"spec", "config", "featureGates"}); err != nil {
		return nil, err
	}
	return cdi, nil
}

// macRange is the MAC pool range: the HCO's, else a locally administered
// /24 range derived from the HCO's identity, stable across reconciles
// (CNAO picks a random prefix once; nodevirt derives one).
func macRange(hc *hcov1beta1.HyperConverged) (start, end string) {
	if c := hc.Spec.KubeMacPoolConfiguration; c != nil && c.RangeStart != nil && c.RangeEnd != nil {
		return *c.RangeStart, *c.RangeEnd
	}
	sum := sha256.Sum256([]byte(hc.Namespace + "/" + hc.Name + "/" + string(hc.UID)))
	prefix := fmt.Sprintf("02:%02x:%02x", sum[0], sum[1])
	return prefix + ":00:00:00", prefix + ":ff:ff:ff"
}

func durationString(d *metav1.Duration) string {
	if d == nil {
		return ""
	}
	return d.Duration.String()
}

func renderCNAO(hc *hcov1beta1.HyperConverged, version string) (*cnaov1.NetworkAddonsConfig, error) {
	s := &hc.Spec
	start, end := macRange(hc)
	spec := cnaov1.NetworkAddonsConfigSpec{
		Multus:      &cnaov1.Multus{},
		LinuxBridge: &cnaov1.LinuxBridge{},
		KubeMacPool: &cnaov1.KubeMacPool{RangeStart: start, RangeEnd: end},
		SelfSignConfiguration: &cnaov1.SelfSignConfiguration{
			CARotateInterval: durationString(s.CertConfig.CA.Duration), CAOverlapInterval: durationString(s.CertConfig.CA.RenewBefore),
			CertRotateInterval: durationString(s.CertConfig.Server.Duration), CertOverlapInterval: durationString(s.CertConfig.Server.RenewBefore),
		},
		TLSSecurityProfile: EffectiveTLSProfile(s.TLSSecurityProfile),
	}
	if s.FeatureGates.DeployKubeSecondaryDNS != nil && *s.FeatureGates.DeployKubeSecondaryDNS {
		spec.KubeSecondaryDNS = &struct{}{}
	}
	if s.Infra.NodePlacement != nil || s.Workloads.NodePlacement != nil {
		spec.PlacementConfiguration = &cnaov1.PlacementConfiguration{
			Infra: s.Infra.NodePlacement, Workloads: s.Workloads.NodePlacement,
		}
	}
	nac := &cnaov1.NetworkAddonsConfig{
		TypeMeta:   metav1.TypeMeta{APIVersion: cnaov1.SchemeGroupVersion.String(), Kind: "NetworkAddonsConfig"},
		ObjectMeta: metav1.ObjectMeta{Name: CNAOName, Labels: labels(hc, "network", version, true)},
		Spec:       spec,
	}
	if err := applyPatchAnnotation(hc, hcov1beta1.JSONPatchCNAOAnnotation, nac); err != nil {
		return nil, err
	}
	return nac, nil
}

func renderSSP(hc *hcov1beta1.HyperConverged, version string) (*sspv1beta2.SSP, error) {
	s := &hc.Spec
	ns := defaultTemplatesNamespace
	if s.CommonTemplatesNamespace != nil {
		ns = *s.CommonTemplatesNamespace
	}
	spec := sspv1beta2.SSPSpec{
		TemplateValidator:  &sspv1beta2.TemplateValidator{Replicas: ptrTo(defaultValidatorReplicas), Placement: s.Infra.NodePlacement},
		CommonTemplates:    sspv1beta2.CommonTemplates{Namespace: ns, DataImportCronTemplates: dataImportCronTemplates(s)},
		TLSSecurityProfile: EffectiveTLSProfile(s.TLSSecurityProfile),
	}
	if s.TektonPipelinesNamespace != nil {
		spec.TektonPipelines = &sspv1beta2.TektonObjects{Namespace: *s.TektonPipelinesNamespace}
	}
	if s.TektonTasksNamespace != nil {
		spec.TektonTasks = &sspv1beta2.TektonObjects{Namespace: *s.TektonTasksNamespace}
	}
	if s.DeployVMConsoleProxy != nil && *s.DeployVMConsoleProxy {
		spec.FeatureGates = &sspv1beta2.SSPFeatureGates{DeployVmConsoleProxy: true}
	}
	if d := s.FeatureGates.DeployTektonTaskResources; d != nil && *d {
		if spec.FeatureGates == nil {
			spec.FeatureGates = &sspv1beta2.SSPFeatureGates{}
		}
		spec.FeatureGates.DeployTektonTaskResources = true
	}
	ssp := &sspv1beta2.SSP{
		TypeMeta:   metav1.TypeMeta{APIVersion: sspv1beta2.SchemeGroupVersion.String(), Kind: "SSP"},
		ObjectMeta: ownedMeta(hc, SSPName, "schedule", version),
		Spec:       spec,
	}
	if err := applyPatchAnnotation(hc, hcov1beta1.JSONPatchSSPAnnotation, ssp); err != nil {
		return nil, err
	}
	return ssp, nil
}

func renderHPP(hc *hcov1beta1.HyperConverged, version string) *hppv1beta1.HostPathProvisioner {
	s := &hc.Spec
	if len(s.StoragePools) == 0 {
		return nil
	}
	hpp := &hppv1beta1.HostPathProvisioner{
		TypeMeta:   metav1.TypeMeta{APIVersion: hppv1beta1.SchemeGroupVersion.String(), Kind: "HostPathProvisioner"},
		ObjectMeta: metav1.ObjectMeta{Name: HPPName, Labels: labels(hc, "storage", version, true)},
		Spec:       hppv1beta1.HostPathProvisionerSpec{ImagePullPolicy: "IfNotPresent"},
	}
	for _, p := range s.StoragePools {
		hpp.Spec.StoragePools = append(hpp.Spec.StoragePools, hppv1beta1.StoragePool{Name: p.Name, Path: p.Path})
	}
	if np := s.Workloads.NodePlacement; np != nil {
		hpp.Spec.Workload = hppv1beta1.NodePlacement{NodeSelector: maps.Clone(np.NodeSelector), Affinity: np.Affinity.DeepCopy(), Tolerations: slices.Clone(np.Tolerations)}
	}
	return hpp
}

// normalize round-trips obj through JSON so that a rendered object compares
// equal to what the API server stores.
func normalize[T any](obj T) T {
	var out T
	data, err := json.Marshal(obj)
	if err != nil {
		panic(err) // API types always marshal
	}
	if err := json.Unmarshal(data, &out); err != nil {
		panic(err)
	}
	return out
}
