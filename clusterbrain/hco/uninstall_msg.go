package hco

import "strings"

// blockingMessage explains why workloads block an uninstall ("" when none
// do), in the words KubeVirt's and CDI's deletion webhooks use.
func blockingMessage(vms, vmis, dvs int) string {
	var kinds []string
	if vms > 0 {
		kinds = append(kinds, "Virtual Machines")
	}
	if vmis > 0 {
		kinds = append(kinds, "Virtual Machine Instances")
	}
	if len(kinds) > 0 {
		return "Rejecting the uninstall request, since there are still " + strings.Join(kinds, " and ") +
			" present. Either delete all KubeVirt related workloads or change the uninstall strategy before uninstalling KubeVirt."
	}
	if dvs > 0 {
		return "Rejecting the uninstall request, since there are still DataVolumes present. " +
			"Either delete all DataVolumes or change the uninstall strategy before uninstalling CDI."
	}
	return ""
}
