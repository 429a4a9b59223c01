package hco

import (
	"encoding/json"
	"reflect"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// Defaults upstream HCO declares on its CRD (kubebuilder defaults), which the
// brain writes into the object since nodevirt's CRD schemas carry none.
const (
	defaultParallelMigrationsPerCluster      = 5
	defaultParallelOutboundMigrationsPerNode = 1
	defaultCompletionTimeoutPerGiB           = 20
	defaultProgressTimeout                   = 150
	defaultBatchEvictionSize                 = 10
	defaultBatchEvictionInterval             = time.Minute
	defaultVMICPUAllocationRatio             = 10
	defaultMemoryOvercommitPercentage        = 100
	defaultCADuration                        = 48 * time.Hour
	defaultCARenewBefore                     = 24 * time.Hour
	defaultServerDuration                    = 24 * time.Hour
	defaultServerRenewBefore                 = 12 * time.Hour
)

func ptrTo[T any](v T) *T { return &v }

func setBool(p **bool, v bool) {
	if *p == nil {
		*p = ptrTo(v)
	}
}

func setDuration(p **metav1.Duration, d time.Duration) {
	if *p == nil {
		*p = &metav1.Duration{Duration: d}
	}
}

// SetDefaults fills every unset field that upstream HCO defaults, with
// upstream's values, and reports whether anything changed.
func SetDefaults(hc *hcov1beta1.HyperConverged) bool {
	before, _ := json.Marshal(hc.Spec)
	s := &hc.Spec

	fg := &s.FeatureGates
	setBool(&fg.DownwardMetrics, false)
	setBool(&fg.DeployKubeSecondaryDNS, false)
	setBool(&fg.AlignCPUs, false)
	setBool(&fg.EnableMultiArchBootImageImport, false)
	setBool(&fg.DecentralizedLiveMigration, true)
	setBool(&fg.DeclarativeHotplugVolumes, true)
	setBool(&fg.ObjectGraph, false)
	setBool(&fg.IncrementalBackup, false)
	setBool(&fg.ContainerPathVolumes, false)

	lm := &s.LiveMigrationConfig
	if lm.ParallelMigrationsPerCluster == nil {
		lm.ParallelMigrationsPerCluster = ptrTo[uint32](defaultParallelMigrationsPerCluster)
	}
	if lm.ParallelOutboundMigrationsPerNode == nil {
		lm.ParallelOutboundMigrationsPerNode = ptrTo[uint32](defaultParallelOutboundMigrationsPerNode)
	}
	if lm.CompletionTimeoutPerGiB == nil {
		lm.CompletionTimeoutPerGiB = ptrTo[int64](defaultCompletionTimeoutPerGiB)
	}
	if lm.ProgressTimeout == nil {
		lm.ProgressTimeout = ptrTo[int64](defaultProgressTimeout)
	}
	setBool(&lm.AllowAutoConverge, false)
	setBool(&lm.AllowPostCopy, false)

	cc := &s.CertConfig
	setDuration(&cc.CA.Duration, defaultCADuration)
	setDuration(&cc.CA.RenewBefore, defaultCARenewBefore)
	setDuration(&cc.Server.Duration, defaultServerDuration)
	setDuration(&cc.Server.RenewBefore, defaultServerRenewBefore)

	if s.ResourceRequirements != nil && s.ResourceRequirements.VmiCPUAllocationRatio == nil {
		s.ResourceRequirements.VmiCPUAllocationRatio = ptrTo(defaultVMICPUAllocationRatio)
	}

	wus := &s.WorkloadUpdateStrategy
	if wus.WorkloadUpdateMethods == nil {
		wus.WorkloadUpdateMethods = []string{"LiveMigrate"}
	}
	if wus.BatchEvictionSize == nil {
		wus.BatchEvictionSize = ptrTo(defaultBatchEvictionSize)
	}
	setDuration(&wus.BatchEvictionInterval, defaultBatchEvictionInterval)

	if s.UninstallStrategy == "" {
		s.UninstallStrategy = hcov1beta1.BlockUninstallIfWorkloadsExist
	}
	if s.VirtualMachineOptions == nil {
		s.VirtualMachineOptions = &hcov1beta1.VirtualMachineOptions{}
	}
	setBool(&s.VirtualMachineOptions.DisableFreePageReporting, false)
	setBool(&s.VirtualMachineOptions.DisableSerialConsoleLog, false)
	if s.HigherWorkloadDensity == nil {
		s.HigherWorkloadDensity = &hcov1beta1.HigherWorkloadDensityConfiguration{}
	}
	if s.HigherWorkloadDensity.MemoryOvercommitPercentage == 0 {
		s.HigherWorkloadDensity.MemoryOvercommitPercentage = defaultMemoryOvercommitPercentage
	}
	setBool(&s.EnableCommonBootImageImport, true)
	setBool(&s.DeployVMConsoleProxy, false)
	setBool(&s.EnableApplicationAwareQuota, false)

	after, _ := json.Marshal(hc.Spec)
	return !reflect.DeepEqual(before, after)
}
