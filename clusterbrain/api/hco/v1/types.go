// Package v1 holds the hco.kubevirt.io/v1 HyperConverged shape: the same
// configuration as v1beta1 grouped by concern (virtualization, storage,
// networking, workloadSources, security, deployment) with feature gates as
// a list of named states. The API server stores v1beta1; package
// hcoconvert converts between the two (the CRD's conversion webhook).
package v1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	apis "github.com/nodevirt/nodevirt/clusterbrain/api"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	corev1 "k8s.io/api/core/v1"
)

// SchemeGroupVersion is the group and version of this package.
var SchemeGroupVersion = schema.GroupVersion{Group: "hco.kubevirt.io", Version: "v1"}

// HyperConverged is the v1 shape of the platform's configuration.
type HyperConverged struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              HyperConvergedSpec              `json:"spec,omitempty"`
	Status            hcov1beta1.HyperConvergedStatus `json:"status,omitempty"`
}

// HyperConvergedList is a list of HyperConverged.
type HyperConvergedList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []HyperConverged `json:"items"`
}

// HyperConvergedSpec groups the configuration by concern.
type HyperConvergedSpec struct {
	FeatureGates    []FeatureGate         `json:"featureGates,omitempty"`
	Virtualization  VirtualizationConfig  `json:"virtualization,omitempty"`
	Storage         *StorageConfig        `json:"storage,omitempty"`
	Networking      *NetworkingConfig     `json:"networking,omitempty"`
	WorkloadSources WorkloadSourcesConfig `json:"workloadSources,omitempty"`
	Security        SecurityConfig        `json:"security,omitempty"`
	Deployment      DeploymentConfig      `json:"deployment,omitempty"`
	Observability   *ObservabilityConfig  `json:"observability,omitempty"`
}

// FeatureGate is one named gate; a missing state means Enabled.
type FeatureGate struct {
	Name  string `json:"name"`
	State string `json:"state,omitempty"`
}

// Feature gate states.
const (
	Enabled  = "Enabled"
	Disabled = "Disabled"
)

// VirtualizationConfig configures KubeVirt.
type VirtualizationConfig struct {
	TuningPolicy                       string                                          `json:"tuningPolicy,omitempty"`
	LiveMigrationConfig                hcov1beta1.LiveMigrationConfigurations          `json:"liveMigrationConfig,omitempty"`
	PermittedHostDevices               *kubevirtv1.PermittedHostDevices                `json:"permittedHostDevices,omitempty"`
	WorkloadUpdateStrategy             hcov1beta1.HyperConvergedWorkloadUpdateStrategy `json:"workloadUpdateStrategy,omitempty"`
	ObsoleteCPUModels                  []string                                        `json:"obsoleteCPUModels,omitempty"`
	EvictionStrategy                   *kubevirtv1.EvictionStrategy                    `json:"evictionStrategy,omitempty"`
	VirtualMachineOptions              *VirtualMachineOptions                          `json:"virtualMachineOptions,omitempty"`
	HigherWorkloadDensity              *hcov1beta1.HigherWorkloadDensityConfiguration  `json:"higherWorkloadDensity,omitempty"`
	LiveUpdateConfiguration            *kubevirtv1.LiveUpdateConfiguration             `json:"liveUpdateConfiguration,omitempty"`
	KSMConfiguration                   *kubevirtv1.KSMConfiguration                    `json:"ksmConfiguration,omitempty"`
	VmiCPUAllocationRatio              *int                                            `json:"vmiCPUAllocationRatio,omitempty"`
	AutoCPULimitNamespaceLabelSelector *metav1.LabelSelector                           `json:"autoCPULimitNamespaceLabelSelector,omitempty"`
}

// VirtualMachineOptions holds VM defaults.
type VirtualMachineOptions struct {
	DisableFreePageReporting *bool   `json:"disableFreePageReporting,omitempty"`
	DisableSerialConsoleLog  *bool   `json:"disableSerialConsoleLog,omitempty"`
	DefaultCPUModel          *string `json:"defaultCPUModel,omitempty"`
	DefaultRuntimeClass      *string `json:"defaultRuntimeClass,omitempty"`
}

// StorageConfig configures CDI and state storage.
type StorageConfig struct {
	VMStateStorageClass          *string                         `json:"vmStateStorageClass,omitempty"`
	ScratchSpaceStorageClass     *string                         `json:"scratchSpaceStorageClass,omitempty"`
	StorageImport                *hcov1beta1.StorageImportConfig `json:"storageImport,omitempty"`
	FilesystemOverhead           *cdiv1.FilesystemOverhead       `json:"filesystemOverhead,omitempty"`
	WorkloadResourceRequirements *corev1.ResourceRequirements    `json:"workloadResourceRequirements,omitempty"`
}

// NetworkingConfig configures the network add-ons.
type NetworkingConfig struct {
	KubeSecondaryDNSNameServerIP *string                                      `json:"kubeSecondaryDNSNameServerIP,omitempty"`
	KubeMacPoolConfiguration     *hcov1beta1.KubeMacPoolConfig                `json:"kubeMacPoolConfiguration,omitempty"`
	NetworkBinding               map[string]kubevirtv1.InterfaceBindingPlugin `json:"networkBinding,omitempty"`
}

// WorkloadSourcesConfig configures templates, boot images and instance
// types.
type WorkloadSourcesConfig struct {
	CommonTemplatesNamespace       *string                                   `json:"commonTemplatesNamespace,omitempty"`
	CommonBootImageNamespace       *string                                   `json:"commonBootImageNamespace,omitempty"`
	EnableCommonBootImageImport    *bool                                     `json:"enableCommonBootImageImport,omitempty"`
	EnableMultiArchBootImageImport *bool                                     `json:"enableMultiArchBootImageImport,omitempty"`
	DataImportCronTemplates        []hcov1beta1.DataImportCronTemplate       `json:"dataImportCronTemplates,omitempty"`
	InstancetypeConfig             *kubevirtv1.InstancetypeConfiguration     `json:"instancetypeConfig,omitempty"`
	CommonInstancetypesDeployment  *kubevirtv1.CommonInstancetypesDeployment `json:"commonInstancetypesDeployment,omitempty"`
}

// SecurityConfig holds certificates and TLS settings.
type SecurityConfig struct {
	CertConfig         hcov1beta1.HyperConvergedCertConfig `json:"certConfig,omitempty"`
	TLSSecurityProfile *hcov1beta1.TLSSecurityProfile      `json:"tlsSecurityProfile,omitempty"`
}

// DeploymentConfig holds placement, uninstall and optional components.
type DeploymentConfig struct {
	NodePlacements                 *NodePlacements                       `json:"nodePlacements,omitempty"`
	UninstallStrategy              string                                `json:"uninstallStrategy,omitempty"`
	LogVerbosityConfig             *hcov1beta1.LogVerbosityConfiguration `json:"logVerbosityConfig,omitempty"`
	ApplicationAwareConfig         *ApplicationAwareConfig               `json:"applicationAwareConfig,omitempty"`
	DeployVMConsoleProxy           *bool                                 `json:"deployVmConsoleProxy,omitempty"`
	DeployNetworkResourcesInjector *bool                                 `json:"deployNetworkResourcesInjector,omitempty"`
}

// NodePlacements places infrastructure and workloads.
type NodePlacements struct {
	Infra    *hcov1beta1.NodePlacement `json:"infra,omitempty"`
	Workload *hcov1beta1.NodePlacement `json:"workload,omitempty"`
}

// ApplicationAwareConfig configures application-aware quota.
type ApplicationAwareConfig struct {
	Enable                                    *bool                 `json:"enable,omitempty"`
	VmiCalcConfigName                         *string               `json:"vmiCalcConfigName,omitempty"`
	NamespaceSelector                         *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
	AllowApplicationAwareClusterResourceQuota bool                  `json:"allowApplicationAwareClusterResourceQuota,omitempty"`
}

// ObservabilityConfig narrows the metrics, alerts and recording rules.
type ObservabilityConfig struct {
	Workloads             *ObservabilityWorkloadsConfig `json:"workloads,omitempty"`
	AllowedAlerts         []string                      `json:"allowedAlerts,omitempty"`
	AllowedRecordingRules []string                      `json:"allowedRecordingRules,omitempty"`
}

// ObservabilityWorkloadsConfig narrows workload metrics.
type ObservabilityWorkloadsConfig struct {
	AllowedMetrics []string `json:"allowedMetrics,omitempty"`
}

// DeepCopyObject implements runtime.Object.
func (in *HyperConverged) DeepCopyObject() runtime.Object {
	out := new(HyperConverged)
	apis.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *HyperConvergedList) DeepCopyObject() runtime.Object {
	out := new(HyperConvergedList)
	apis.DeepCopyJSON(in, out)
	return out
}
