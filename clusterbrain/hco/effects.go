package hco

import (
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strings"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// What nodevirt does with each HyperConverged v1beta1 spec field. Every
// field of the type is in exactly one of the tables (TestEveryFieldIsAccountedFor):
// a field with an effect names the package that acts on it; an inert one
// says why, and the hco webhook warns when a HyperConverged sets it (to a
// value other than its default), so no setting is silently ignored. A
// table entry covers everything below its path.
var (
	// effective fields: path → the package that acts on it.
	effective = map[string]string{
		"spec.workloads":                                             "scheduler (VMIs and migration targets only on the nodes it admits, as virt-handler's placement), hostpathprovisioner (the storage pools)",
		"spec.infra":                                                 "hco (the brain's own Deployment, given with --deployment as the manifests do: node selector, affinity and tolerations merged onto its own; a brain not run by a Deployment is not placed)",
		"spec.featureGates.videoConfig":                              "launcher/domain (VideoConfig gate)",
		"spec.featureGates.declarativeHotplugVolumes":                "vmcontroller, subresources (DeclarativeHotplugVolumes or HotplugVolumes gate)",
		"spec.liveUpdateConfiguration.maxCpuSockets":                 "admission, vmcontroller, replicas (api/rollout: the maxSockets a VMI's CPU hotplug goes up to)",
		"spec.liveUpdateConfiguration.maxHotplugRatio":               "admission, vmcontroller, replicas (api/rollout: maxSockets as a multiple of the sockets)",
		"spec.liveMigrationConfig.parallelMigrationsPerCluster":      "migration",
		"spec.liveMigrationConfig.parallelOutboundMigrationsPerNode": "migration",
		"spec.liveMigrationConfig.bandwidthPerMigration":             "migration, nodeagent/handler",
		"spec.liveMigrationConfig.completionTimeoutPerGiB":           "migration, nodeagent/handler",
		"spec.liveMigrationConfig.progressTimeout":                   "migration, nodeagent/handler",
		"spec.liveMigrationConfig.allowAutoConverge":                 "migration, nodeagent/handler",
		"spec.liveMigrationConfig.allowPostCopy":                     "migration, nodeagent/handler (post-copy at the completion timeout)",
		"spec.certConfig":                                            "kit/certs (the brain's certificate durations)",
		"spec.resourceRequirements.vmiCPUAllocationRatio":            "admission (VMI CPU requests)",
		"spec.commonTemplatesNamespace":                              "ssp/templates",
		"spec.storageImport":                                         "importer, dataimportcron, containerdisk (insecure registries)",
		"spec.dataImportCronTemplates":                               "dataimportcron",
		"spec.filesystemOverhead":                                    "datavolume (claim sizes)",
		"spec.uninstallStrategy":                                     "hco (uninstall)",
		"spec.kubeMacPoolConfiguration":                              "macpool",
		"spec.evictionStrategy":                                      "migration (node drain evacuation)",
		"spec.commonBootImageNamespace":                              "hco boot sources, dataimportcron",
		"spec.enableCommonBootImageImport":                           "hco boot sources, dataimportcron",
		"spec.CommonInstancetypesDeployment":                         "instancetypes",
		"spec.storagePools":                                          "hostpathprovisioner, nodeagent/storagepools",
		"spec.defaultCPUModel":                                       "admission, vmcontroller, replicas (api/cpumodel: the model of VMIs created without one)",
		"spec.obsoleteCPUs":                                          "admission, vmcontroller (api/cpumodel: VMIs and VMs naming an obsolete model refused)",
		"spec.tektonPipelinesNamespace":                              "ssp (where the pipeline Tasks and Pipelines go, with featureGates.deployTektonTaskResources)",
		"spec.tektonTasksNamespace":                                  "ssp (where the pipeline Tasks go, with featureGates.deployTektonTaskResources)",
		"spec.higherWorkloadDensity":                                 "admission, vmcontroller, replicas, scheduler, capacitypods (api/overcommit: the memory request of VMIs that give only their guest memory)",
		"spec.logVerbosityConfig.kubevirt":                           "api/logverbosity (the brain's and node agents' log levels, live)",
		"spec.logVerbosityConfig.cdi":                                "api/logverbosity (through the CDI CR: the level of the roles played for CDI, DataVolume, DataImportCron, upload and import, live)",
		"spec.tlsSecurityProfile":                                    "api/tlsprofile (from the KubeVirt and CDI CRs: the brain's webhooks, aggregated APIs, upload API and proxy, the node agents' console and upload servers, live)",
	}
	// inert fields: path → why nodevirt does not act on it.
	inert = map[string]string{
		"spec.localStorageClassName":                                   "nodevirt makes no local storage class from it",
		"spec.tuningPolicy":                                            "the API client rate tuning is not applied",
		"spec.featureGates.downwardMetrics":                            "downward metrics are not served to guests",
		"spec.featureGates.deployKubeSecondaryDNS":                     "no secondary DNS is deployed",
		"spec.featureGates.disableMDevConfiguration":                   "mediated devices are not configured",
		"spec.featureGates.persistentReservation":                      "SCSI persistent reservation is not supported",
		"spec.featureGates.alignCPUs":                                  "emulator thread alignment is not applied",
		"spec.featureGates.enableMultiArchBootImageImport":             "boot sources are amd64 only",
		"spec.featureGates.decentralizedLiveMigration":                 "only the brain-driven migration exists",
		"spec.featureGates.objectGraph":                                "the object graph subresource is not served",
		"spec.featureGates.incrementalBackup":                          "backups are not supported",
		"spec.featureGates.containerPathVolumes":                       "container path volumes are not supported",
		"spec.liveMigrationConfig.network":                             "there is no dedicated migration network: migrations use the node IPs",
		"spec.liveMigrationConfig.allowWorkloadDisruption":             "only a MigrationPolicy's allowWorkloadDisruption is read",
		"spec.permittedHostDevices":                                    "host devices are not passed through (the scheduler applies the list: a VMI naming a GPU or host device it does not list is not scheduled, a listed one waits for a node advertising it)",
		"spec.resourceRequirements.storageWorkloads":                   "imports run inside the node agent, not in pods",
		"spec.resourceRequirements.autoCPULimitNamespaceLabelSelector": "CPU limits are not set automatically",
		"spec.scratchSpaceStorageClass":                                "imports need no scratch space",
		"spec.vddkInitImage":                                           "VDDK imports are not supported",
		"spec.defaultRuntimeClass":                                     "VMs are not pods: no runtime class",
		"spec.workloadUpdateStrategy":                                  "running VMs are not updated on upgrades",
		"spec.kubeSecondaryDNSNameServerIP":                            "no secondary DNS is deployed",
		"spec.vmStateStorageClass":                                     "there is no persistent VM state (TPM/EFI) volume",
		"spec.virtualMachineOptions":                                   "free page reporting and the serial console log are not configurable",
		"spec.ksmConfiguration":                                        "KSM is not managed",
		"spec.liveUpdateConfiguration.maxGuest":                        "memory is not hot-plugged",
		"spec.networkBinding":                                          "network binding plugins are not supported",
		"spec.deployVmConsoleProxy":                                    "no VM console proxy is deployed",
		"spec.enableApplicationAwareQuota":                             "application aware quota is not deployed",
		"spec.instancetypeConfig":                                      "the instance type reference policy is not applied",
	}
	// warnedElsewhere are the deprecated feature gates, warned about by
	// upstream's own messages (featureGateWarnings).
	warnedElsewhere = map[string]bool{
		"spec.featureGates.withHostPassthroughCPU": true, "spec.featureGates.enableCommonBootImageImport": true,
		"spec.featureGates.deployTektonTaskResources": true, "spec.featureGates.nonRoot": true,
		"spec.featureGates.autoResourceLimits": true, "spec.featureGates.enableManagedTenantQuota": true,
		"spec.featureGates.deployKubevirtIpamController": true, "spec.featureGates.deployVmConsoleProxy": true,
		"spec.featureGates.enableApplicationAwareQuota": true, "spec.featureGates.primaryUserDefinedNetworkBinding": true,
	}
)

// inertWarnings names each inert field hc sets to a value other than its
// default (and, on update, other than old's): "spec.x has no effect in
// nodevirt: why".
func inertWarnings(hc, old *hcov1beta1.HyperConverged) []string {
	defaults := &hcov1beta1.HyperConverged{}
	SetDefaults(defaults)
	def, cur := specValues(defaults), specValues(hc)
	var before map[string]string
	if old != nil {
		o := old.DeepCopyObject().(*hcov1beta1.HyperConverged)
		SetDefaults(o)
		before = specValues(o)
	}
	paths := make([]string, 0, len(cur))
	for p := range cur {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var out []string
	for _, p := range paths {
		if cur[p] == def[p] || before != nil && cur[p] == before[p] {
			continue
		}
		out = append(out, fmt.Sprintf("%s has no effect in nodevirt: %s", p, inert[p]))
	}
	return out
}

// specValues returns the JSON of every inert field hc's spec sets, by path.
func specValues(hc *hcov1beta1.HyperConverged) map[string]string {
	data, _ := json.Marshal(hc.Spec)
	var m map[string]any
	_ = json.Unmarshal(data, &m)
	out := map[string]string{}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			p := prefix + "." + k
			switch {
			case inert[p] != "":
				b, _ := json.Marshal(v)
				out[p] = string(b)
			case effective[p] != "" || warnedElsewhere[p]:
			default:
				if sub, ok := v.(map[string]any); ok {
					walk(p, sub)
				}
			}
		}
	}
	walk("spec", m)
	return out
}

// unaccounted lists the fields of t (a struct type, at path) that no table
// covers; used by the tests to keep the tables complete. A struct of
// another package is looked into when a table names a path below it.
func unaccounted(path string, t reflect.Type) []string {
	tabledBelow := func(p string) bool {
		for _, table := range []map[string]string{effective, inert} {
			for k := range table {
				if strings.HasPrefix(k, p+".") {
					return true
				}
			}
		}
		return false
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var out []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		p := path + "." + name
		if effective[p] != "" || inert[p] != "" || warnedElsewhere[p] {
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && (ft.PkgPath() == reflect.TypeOf(hcov1beta1.HyperConvergedSpec{}).PkgPath() || tabledBelow(p)) {
			out = append(out, unaccounted(p, ft)...)
			continue
		}
		out = append(out, p)
	}
	return out
}
