// Package manifests holds what the pipeline tasks program is deployed
// with: the tekton.dev/v1 Task manifests that run nodevirt-tasks, the
// example Pipelines, and each task's RBAC rules. It is a leaf the brain's
// SSP role reads (the program itself is a client and stays out of the
// brain).
package manifests

import (
	"embed"
	"sort"
	"strings"

	rbacv1 "k8s.io/api/rbac/v1"
)

//go:embed tasks/*.yaml
var taskFiles embed.FS

//go:embed pipelines/*.yaml
var pipelineFiles embed.FS

// Tasks returns the tekton.dev/v1 Task manifests, by file name.
func Tasks() (map[string][]byte, error) {
	entries, err := taskFiles.ReadDir("tasks")
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for _, e := range entries {
		data, err := taskFiles.ReadFile("tasks/" + e.Name())
		if err != nil {
			return nil, err
		}
		out[e.Name()] = data
	}
	return out, nil
}

// Pipelines returns the example tekton.dev/v1 Pipelines, by file name.
// Their taskRefs name the Tasks through the cluster resolver in the
// namespace TasksNamespacePlaceholder stands for.
func Pipelines() (map[string][]byte, error) {
	entries, err := pipelineFiles.ReadDir("pipelines")
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for _, e := range entries {
		data, err := pipelineFiles.ReadFile("pipelines/" + e.Name())
		if err != nil {
			return nil, err
		}
		out[e.Name()] = data
	}
	return out, nil
}

// TasksNamespacePlaceholder in a Pipeline is replaced by the namespace
// the Tasks are deployed in.
const TasksNamespacePlaceholder = "NODEVIRT_TASKS_NAMESPACE"

func policy(group string, resources []string, verbs ...string) rbacv1.PolicyRule {
	return rbacv1.PolicyRule{APIGroups: []string{group}, Resources: resources, Verbs: verbs}
}

// TaskRules are what each task's ServiceAccount may do (as upstream's
// ClusterRoles grant, bound in the Tasks' namespace), by task name.
func TaskRules() map[string][]rbacv1.PolicyRule {
	vmsRW := policy("kubevirt.io", []string{"virtualmachines", "virtualmachineinstances"}, "get", "list", "watch", "create", "update", "patch", "delete")
	vmSub := policy("subresources.kubevirt.io", []string{"virtualmachines/start", "virtualmachines/stop", "virtualmachines/restart"}, "update")
	templatesRW := policy("template.openshift.io", []string{"templates"}, "get", "list", "watch", "create", "update", "patch", "delete")
	process := policy("template.openshift.io", []string{"processedtemplates"}, "create")
	pods := policy("", []string{"pods"}, "get")
	return map[string][]rbacv1.PolicyRule{
		"create-vm-from-manifest": {vmsRW},
		"create-vm-from-template": {vmsRW, policy("template.openshift.io", []string{"templates"}, "get", "list", "watch"), process},
		"copy-template":           {templatesRW, pods},
		"modify-vm-template":      {templatesRW},
		"modify-data-object": {policy("cdi.kubevirt.io", []string{"datavolumes", "datasources"}, "get", "create", "delete"),
			policy("", []string{"persistentvolumeclaims"}, "get", "delete"), pods},
		"cleanup-vm":          {vmsRW, vmSub},
		"wait-for-vmi-status": {policy("kubevirt.io", []string{"virtualmachineinstances"}, "get", "list", "watch")},
		"generate-ssh-keys":   {policy("", []string{"secrets"}, "get", "list", "create", "patch", "delete")},
		"execute-in-vm": {policy("kubevirt.io", []string{"virtualmachines", "virtualmachineinstances"}, "get", "list", "watch"), vmSub,
			policy("", []string{"secrets"}, "get")},
		"disk-virt-customize": {policy("", []string{"persistentvolumeclaims"}, "get"), policy("kubevirt.io", []string{"virtualmachineinstances"}, "list")},
		"disk-virt-sysprep":   {policy("", []string{"persistentvolumeclaims"}, "get"), policy("kubevirt.io", []string{"virtualmachineinstances"}, "list")},
	}
}

// TaskNames are the tasks with a manifest, sorted.
func TaskNames() []string {
	files, _ := Tasks()
	var out []string
	for f := range files {
		out = append(out, strings.TrimSuffix(f, ".yaml"))
	}
	sort.Strings(out)
	return out
}
