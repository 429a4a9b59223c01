// Package v1beta1 is hco.kubevirt.io/v1beta1: the HyperConverged resource,
// the single entry point of the platform's configuration.
package v1beta1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api"
)

// SchemeGroupVersion is the group and version of this package.
var SchemeGroupVersion = schema.GroupVersion{Group: "hco.kubevirt.io", Version: "v1beta1"}

const (
	// Name is the only accepted name of the HyperConverged resource.
	Name = "kubevirt-hyperconverged"
	// DefaultNamespace is where the lab creates it.
	DefaultNamespace = "kubevirt-hyperconverged"
)

// Condition types of the HyperConverged status.
const (
	ConditionReconcileComplete    = "ReconcileComplete"
	ConditionAvailable            = "Available"
	ConditionProgressing          = "Progressing"
	ConditionDegraded             = "Degraded"
	ConditionUpgradeable          = "Upgradeable"
	ConditionTaintedConfiguration = "TaintedConfiguration"
)

// Annotations upstream HCO reads on the HyperConverged: JSON patches applied
// to one child's rendering (unsupported, they taint the configuration).
const (
	JSONPatchKubeVirtAnnotation = "kubevirt.kubevirt.io/jsonpatch"
	JSONPatchCDIAnnotation      = "containerizeddataimporter.kubevirt.io/jsonpatch"
	JSONPatchCNAOAnnotation     = "networkaddonsconfigs.kubevirt.io/jsonpatch"
	JSONPatchSSPAnnotation      = "ssp.kubevirt.io/jsonpatch"
	// UseEmulationAnnotation set to "true" makes KubeVirt fall back to
	// software emulation (nodevirt's convenience for hosts without KVM).
	UseEmulationAnnotation = "nodevirt.io/use-emulation"
)

// Uninstall strategies.
const (
	RemoveWorkloads                = "RemoveWorkloads"
	BlockUninstallIfWorkloadsExist = "BlockUninstallIfWorkloadsExist"
)

// HyperConverged is the Schema for the hyperconvergeds API.
type HyperConverged struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              HyperConvergedSpec   `json:"spec,omitempty"`
	Status            HyperConvergedStatus `json:"status,omitempty"`
}

// HyperConvergedList is a list of HyperConverged.
type HyperConvergedList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []HyperConverged `json:"items"`
}

// HyperConvergedSpec defines the desired state of the platform.
type HyperConvergedSpec struct {
	LocalStorageClassName         string                                       `json:"localStorageClassName,omitempty"`
	TuningPolicy                  string                                       `json:"tuningPolicy,omitempty"`
	Infra                         HyperConvergedConfig                         `json:"infra,omitempty"`
	Workloads                     HyperConvergedConfig                         `json:"workloads,omitempty"`
	FeatureGates                  HyperConvergedFeatureGates                   `json:"featureGates,omitempty"`
	LiveMigrationConfig           LiveMigrationConfigurations                  `json:"liveMigrationConfig,omitempty"`
	PermittedHostDevices          *kubevirtv1.PermittedHostDevices             `json:"permittedHostDevices,omitempty"`
	CertConfig                    HyperConvergedCertConfig                     `json:"certConfig,omitempty"`
	ResourceRequirements          *OperandResourceRequirements                 `json:"resourceRequirements,omitempty"`
	ScratchSpaceStorageClass      *string                                      `json:"scratchSpaceStorageClass,omitempty"`
	VDDKInitImage                 *string                                      `json:"vddkInitImage,omitempty"`
	DefaultCPUModel               *string                                      `json:"defaultCPUModel,omitempty"`
	DefaultRuntimeClass           *string                                      `json:"defaultRuntimeClass,omitempty"`
	ObsoleteCPUs                  *HyperConvergedObsoleteCPUs                  `json:"obsoleteCPUs,omitempty"`
	CommonTemplatesNamespace      *string                                      `json:"commonTemplatesNamespace,omitempty"`
	StorageImport                 *StorageImportConfig                         `json:"storageImport,omitempty"`
	WorkloadUpdateStrategy        HyperConvergedWorkloadUpdateStrategy         `json:"workloadUpdateStrategy,omitempty"`
	DataImportCronTemplates       []DataImportCronTemplate                     `json:"dataImportCronTemplates,omitempty"`
	FilesystemOverhead            *cdiv1.FilesystemOverhead                    `json:"filesystemOverhead,omitempty"`
	UninstallStrategy             string                                       `json:"uninstallStrategy,omitempty"`
	LogVerbosityConfig            *LogVerbosityConfiguration                   `json:"logVerbosityConfig,omitempty"`
	TLSSecurityProfile            *TLSSecurityProfile                          `json:"tlsSecurityProfile,omitempty"`
	TektonPipelinesNamespace      *string                                      `json:"tektonPipelinesNamespace,omitempty"`
	TektonTasksNamespace          *string                                      `json:"tektonTasksNamespace,omitempty"`
	KubeSecondaryDNSNameServerIP  *string                                      `json:"kubeSecondaryDNSNameServerIP,omitempty"`
	KubeMacPoolConfiguration      *KubeMacPoolConfig                           `json:"kubeMacPoolConfiguration,omitempty"`
	EvictionStrategy              *kubevirtv1.EvictionStrategy                 `json:"evictionStrategy,omitempty"`
	VMStateStorageClass           *string                                      `json:"vmStateStorageClass,omitempty"`
	VirtualMachineOptions         *VirtualMachineOptions                       `json:"virtualMachineOptions,omitempty"`
	CommonBootImageNamespace      *string                                      `json:"commonBootImageNamespace,omitempty"`
	KSMConfiguration              *kubevirtv1.KSMConfiguration                 `json:"ksmConfiguration,omitempty"`
	LiveUpdateConfiguration       *kubevirtv1.LiveUpdateConfiguration          `json:"liveUpdateConfiguration,omitempty"`
	NetworkBinding                map[string]kubevirtv1.InterfaceBindingPlugin `json:"networkBinding,omitempty"`
	HigherWorkloadDensity         *HigherWorkloadDensityConfiguration          `json:"higherWorkloadDensity,omitempty"`
	EnableCommonBootImageImport   *bool                                        `json:"enableCommonBootImageImport,omitempty"`
	DeployVMConsoleProxy          *bool                                        `json:"deployVmConsoleProxy,omitempty"`
	EnableApplicationAwareQuota   *bool                                        `json:"enableApplicationAwareQuota,omitempty"`
	CommonInstancetypesDeployment *kubevirtv1.CommonInstancetypesDeployment    `json:"CommonInstancetypesDeployment,omitempty"`
	InstancetypeConfig            *kubevirtv1.InstancetypeConfiguration        `json:"instancetypeConfig,omitempty"`
	// StoragePools, when set, makes the platform render a HostPathProvisioner
	// with these pools (nodevirt's equivalent of deploying HPP alongside).
	StoragePools []StoragePool `json:"storagePools,omitempty"`
}

// StoragePool is a named directory on every node for node-local volumes.
type StoragePool struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// HyperConvergedConfig holds placement for a group of components.
type HyperConvergedConfig struct {
	NodePlacement *NodePlacement `json:"nodePlacement,omitempty"`
}

// NodePlacement describes node scheduling configuration.
type NodePlacement struct {
	NodeSelector map[string]string   `json:"nodeSelector,omitempty"`
	Affinity     *corev1.Affinity    `json:"affinity,omitempty"`
	Tolerations  []corev1.Toleration `json:"tolerations,omitempty"`
}

// HyperConvergedFeatureGates are the optional features of the platform.
type HyperConvergedFeatureGates struct {
	DownwardMetrics                *bool `json:"downwardMetrics,omitempty"`
	DeployKubeSecondaryDNS         *bool `json:"deployKubeSecondaryDNS,omitempty"`
	DisableMDevConfiguration       *bool `json:"disableMDevConfiguration,omitempty"`
	PersistentReservation          *bool `json:"persistentReservation,omitempty"`
	AlignCPUs                      *bool `json:"alignCPUs,omitempty"`
	EnableMultiArchBootImageImport *bool `json:"enableMultiArchBootImageImport,omitempty"`
	DecentralizedLiveMigration     *bool `json:"decentralizedLiveMigration,omitempty"`
	DeclarativeHotplugVolumes      *bool `json:"declarativeHotplugVolumes,omitempty"`
	VideoConfig                    *bool `json:"videoConfig,omitempty"`
	ObjectGraph                    *bool `json:"objectGraph,omitempty"`
	IncrementalBackup              *bool `json:"incrementalBackup,omitempty"`
	ContainerPathVolumes           *bool `json:"containerPathVolumes,omitempty"`
	// Deprecated gates still accepted so that older manifests apply.
	WithHostPassthroughCPU           *bool `json:"withHostPassthroughCPU,omitempty"`
	EnableCommonBootImageImport      *bool `json:"enableCommonBootImageImport,omitempty"`
	DeployTektonTaskResources        *bool `json:"deployTektonTaskResources,omitempty"`
	NonRoot                          *bool `json:"nonRoot,omitempty"`
	AutoResourceLimits               *bool `json:"autoResourceLimits,omitempty"`
	EnableManagedTenantQuota         *bool `json:"enableManagedTenantQuota,omitempty"`
	DeployKubevirtIpamController     *bool `json:"deployKubevirtIpamController,omitempty"`
	DeployVMConsoleProxy             *bool `json:"deployVmConsoleProxy,omitempty"`
	EnableApplicationAwareQuota      *bool `json:"enableApplicationAwareQuota,omitempty"`
	PrimaryUserDefinedNetworkBinding *bool `json:"primaryUserDefinedNetworkBinding,omitempty"`
}

// LiveMigrationConfigurations configures live migration.
type LiveMigrationConfigurations struct {
	ParallelMigrationsPerCluster      *uint32 `json:"parallelMigrationsPerCluster,omitempty"`
	ParallelOutboundMigrationsPerNode *uint32 `json:"parallelOutboundMigrationsPerNode,omitempty"`
	BandwidthPerMigration             *string `json:"bandwidthPerMigration,omitempty"`
	CompletionTimeoutPerGiB           *int64  `json:"completionTimeoutPerGiB,omitempty"`
	ProgressTimeout                   *int64  `json:"progressTimeout,omitempty"`
	Network                           *string `json:"network,omitempty"`
	AllowAutoConverge                 *bool   `json:"allowAutoConverge,omitempty"`
	AllowPostCopy                     *bool   `json:"allowPostCopy,omitempty"`
	AllowWorkloadDisruption           *bool   `json:"allowWorkloadDisruption,omitempty"`
}

// CertRotateConfigCA configures a CA's lifetime.
type CertRotateConfigCA struct {
	Duration    *metav1.Duration `json:"duration,omitempty"`
	RenewBefore *metav1.Duration `json:"renewBefore,omitempty"`
}

// CertRotateConfigServer configures a serving certificate's lifetime.
type CertRotateConfigServer struct {
	Duration    *metav1.Duration `json:"duration,omitempty"`
	RenewBefore *metav1.Duration `json:"renewBefore,omitempty"`
}

// HyperConvergedCertConfig holds the certificate rotation settings.
type HyperConvergedCertConfig struct {
	CA     CertRotateConfigCA     `json:"ca,omitempty"`
	Server CertRotateConfigServer `json:"server,omitempty"`
}

// OperandResourceRequirements configures resources of workloads.
type OperandResourceRequirements struct {
	StorageWorkloads                   *corev1.ResourceRequirements `json:"storageWorkloads,omitempty"`
	VmiCPUAllocationRatio              *int                         `json:"vmiCPUAllocationRatio,omitempty"`
	AutoCPULimitNamespaceLabelSelector *metav1.LabelSelector        `json:"autoCPULimitNamespaceLabelSelector,omitempty"`
}

// HyperConvergedObsoleteCPUs lists CPU models never used for VMs.
type HyperConvergedObsoleteCPUs struct {
	MinCPUModel string   `json:"minCPUModel,omitempty"`
	CPUModels   []string `json:"cpuModels,omitempty"`
}

// StorageImportConfig holds the import settings.
type StorageImportConfig struct {
	InsecureRegistries []string `json:"insecureRegistries,omitempty"`
}

// HyperConvergedWorkloadUpdateStrategy says how running VMs follow upgrades.
type HyperConvergedWorkloadUpdateStrategy struct {
	WorkloadUpdateMethods []string         `json:"workloadUpdateMethods,omitempty"`
	BatchEvictionSize     *int             `json:"batchEvictionSize,omitempty"`
	BatchEvictionInterval *metav1.Duration `json:"batchEvictionInterval,omitempty"`
}

// DataImportCronTemplate is a golden-image import schedule.
type DataImportCronTemplate struct {
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              *cdiv1.DataImportCronSpec `json:"spec,omitempty"`
}

// LogVerbosityConfiguration configures component log levels.
type LogVerbosityConfiguration struct {
	Kubevirt *kubevirtv1.LogVerbosity `json:"kubevirt,omitempty"`
	CDI      *int32                   `json:"cdi,omitempty"`
}

// TLSSecurityProfile is OpenShift's TLS profile shape.
type TLSSecurityProfile struct {
	Type         string            `json:"type,omitempty"`
	Old          *struct{}         `json:"old,omitempty"`
	Intermediate *struct{}         `json:"intermediate,omitempty"`
	Modern       *struct{}         `json:"modern,omitempty"`
	Custom       *CustomTLSProfile `json:"custom,omitempty"`
}

// CustomTLSProfile lists ciphers and a minimum version.
type CustomTLSProfile struct {
	Ciphers       []string `json:"ciphers,omitempty"`
	MinTLSVersion string   `json:"minTLSVersion,omitempty"`
}

// KubeMacPoolConfig is the MAC pool range.
type KubeMacPoolConfig struct {
	RangeStart *string `json:"rangeStart,omitempty"`
	RangeEnd   *string `json:"rangeEnd,omitempty"`
}

// VirtualMachineOptions holds VM defaults.
type VirtualMachineOptions struct {
	DisableFreePageReporting *bool `json:"disableFreePageReporting,omitempty"`
	DisableSerialConsoleLog  *bool `json:"disableSerialConsoleLog,omitempty"`
}

// HigherWorkloadDensityConfiguration configures memory overcommit.
type HigherWorkloadDensityConfiguration struct {
	MemoryOvercommitPercentage int `json:"memoryOvercommitPercentage,omitempty"`
}

// HyperConvergedStatus is the aggregated state of the platform.
type HyperConvergedStatus struct {
	Conditions                    []metav1.Condition       `json:"conditions,omitempty"`
	RelatedObjects                []corev1.ObjectReference `json:"relatedObjects,omitempty"`
	Versions                      []Version                `json:"versions,omitempty"`
	ObservedGeneration            int64                    `json:"observedGeneration,omitempty"`
	SystemHealthStatus            string                   `json:"systemHealthStatus,omitempty"`
	InfrastructureHighlyAvailable *bool                    `json:"infrastructureHighlyAvailable,omitempty"`
}

// Version is a component's version.
type Version struct {
	Name    string `json:"name,omitempty"`
	Version string `json:"version,omitempty"`
}

// DeepCopyObject implements runtime.Object.
func (in *HyperConverged) DeepCopyObject() runtime.Object {
	out := new(HyperConverged)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *HyperConvergedList) DeepCopyObject() runtime.Object {
	out := new(HyperConvergedList)
	api.DeepCopyJSON(in, out)
	return out
}
