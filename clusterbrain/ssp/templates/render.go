package templates

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Labels and annotations of the common templates and of the VMs made from
// them (upstream's keys).
const (
	LabelOSPrefix       = "os.template.kubevirt.io/"
	LabelWorkloadPrefix = "workload.template.kubevirt.io/"
	LabelFlavorPrefix   = "flavor.template.kubevirt.io/"
	LabelType           = "template.kubevirt.io/type"
	LabelVersion        = "template.kubevirt.io/version"
	LabelDefaultVariant = "template.kubevirt.io/default-os-variant"
	LabelArchitecture   = "template.kubevirt.io/architecture"
	// VM labels naming the template a VM came from.
	LabelVMTemplate          = "vm.kubevirt.io/template"
	LabelVMTemplateNamespace = "vm.kubevirt.io/template.namespace"
	LabelVMTemplateVersion   = "vm.kubevirt.io/template.version"
	LabelVMTemplateRevision  = "vm.kubevirt.io/template.revision"
	// AnnValidations holds a VM's validation rules (JSON).
	AnnValidations = "vm.kubevirt.io/validations"
	// LabelManagedBy marks the templates this role owns.
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedBy      = "nodevirt-ssp"
	LabelName      = "app.kubernetes.io/name"
	NameCommon     = "common-templates"
	// DefaultDataSourceNamespace is where golden images live.
	DefaultDataSourceNamespace = "kubevirt-os-images"
)

// Rule is one validation rule of the vm.kubevirt.io/validations
// annotation.
type Rule struct {
	Name        string   `json:"name"`
	Path        string   `json:"path"`
	Valid       string   `json:"valid,omitempty"`
	Rule        string   `json:"rule"`
	Message     string   `json:"message"`
	Min         *int64   `json:"min,omitempty"`
	Max         *int64   `json:"max,omitempty"`
	MinLength   *int64   `json:"minLength,omitempty"`
	MaxLength   *int64   `json:"maxLength,omitempty"`
	Regex       string   `json:"regex,omitempty"`
	Values      []string `json:"values,omitempty"`
	JustWarning bool     `json:"justWarning,omitempty"`
}

// Name returns the template name of one flavor of os.
func Name(os OS, f Flavor) string { return os.Name + "-" + f.Workload + "-" + f.Name }

// Render returns every common template as a template.openshift.io/v1
// Template object (decoded JSON), in namespace ns.
func Render(ns string) []map[string]any {
	var out []map[string]any
	for _, os := range Catalog() {
		for _, f := range os.Flavors {
			out = append(out, render(os, f, ns))
		}
	}
	return out
}

func render(os OS, f Flavor, ns string) map[string]any {
	name := Name(os, f)
	labels := map[string]any{
		LabelWorkloadPrefix + f.Workload: "true",
		LabelFlavorPrefix + f.Name:       "true",
		LabelType:                        "base",
		LabelVersion:                     Version,
		LabelArchitecture:                Architecture,
		LabelManagedBy:                   ManagedBy,
		LabelName:                        NameCommon,
	}
	ann := map[string]any{
		"openshift.io/display-name":          os.DisplayName,
		"description":                        fmt.Sprintf("%s, %s workload, %s size. The VM's disk is cloned from the DataSource DATA_SOURCE_NAME.", os.DisplayName, f.Workload, f.Name),
		"tags":                               os.Tags,
		"iconClass":                          "icon-" + os.Icon,
		"openshift.io/provider-display-name": "KubeVirt",
		"openshift.io/documentation-url":     "https://github.com/kubevirt/common-templates",
		"openshift.io/support-url":           "https://github.com/kubevirt/common-templates/issues",
		"template.openshift.io/bindable":     "false",
		"template.kubevirt.io/version":       "v1alpha1",
		"defaults.template.kubevirt.io/disk": "rootdisk",
	}
	for _, l := range os.Labels {
		labels[LabelOSPrefix+l] = "true"
		ann["name.os.template.kubevirt.io/"+l] = os.NameOS
	}
	if f.Default {
		labels[LabelDefaultVariant] = "true"
	}
	if os.Deprecated {
		ann["template.kubevirt.io/deprecated"] = "true"
	}
	if len(os.Containerdisks) > 0 {
		ann["template.kubevirt.io/containerdisks"] = strings.Join(os.Containerdisks, "\n") + "\n"
	}
	editable := []string{"cpu.sockets", "cpu.cores", "cpu.threads", "memory.guest", "devices.disks"}
	if os.Windows {
		ann["defaults.template.kubevirt.io/network"] = "default"
		editable = []string{"cpu.cores", "memory.guest", "devices.disks"}
	}
	var ed []string
	for _, e := range editable {
		ed = append(ed, "/objects[0].spec.template.spec.domain."+e)
	}
	ed = append(ed, "/objects[0].spec.template.spec.volumes", "/objects[0].spec.template.spec.networks")
	ann["template.kubevirt.io/editable"] = strings.Join(ed, "\n") + "\n"

	nameFrom := os.NameFrom
	if nameFrom == "" {
		nameFrom = os.Name + linuxGen
	}
	params := []any{
		map[string]any{"name": "NAME", "description": "VM name", "generate": "expression", "from": nameFrom},
		map[string]any{"name": "DATA_SOURCE_NAME", "description": "Name of the DataSource to clone", "value": os.DataSource},
		map[string]any{"name": "DATA_SOURCE_NAMESPACE", "description": "Namespace of the DataSource", "value": DefaultDataSourceNamespace},
	}
	if !os.Windows {
		params = append(params, map[string]any{"name": "CLOUD_USER_PASSWORD", "generate": "expression",
			"from":        "[a-z0-9]{4}-[a-z0-9]{4}-[a-z0-9]{4}",
			"description": "Randomized password for the cloud-init user " + os.CloudUser})
	}
	return map[string]any{
		"apiVersion": "template.openshift.io/v1",
		"kind":       "Template",
		"metadata":   map[string]any{"name": name, "namespace": ns, "labels": labels, "annotations": ann},
		"objects":    []any{vm(os, f, name)},
		"parameters": params,
	}
}

// rules returns the validations of os's VMs.
func rules(os OS) []Rule {
	min := os.MinMemory
	out := []Rule{{Name: "minimal-required-memory", Path: "jsonpath::.spec.domain.memory.guest", Rule: "integer",
		Message: "This VM requires more memory.", Min: &min}}
	if os.Windows {
		disks := "jsonpath::.spec.domain.devices.disks[*].disk.bus"
		cds := "jsonpath::.spec.domain.devices.disks[*].cdrom.bus"
		out = append(out,
			Rule{Name: "windows-virtio-bus", Path: disks, Valid: disks, Rule: "enum", JustWarning: true, Values: []string{"virtio"},
				Message: "virtio disk bus type has better performance, install virtio drivers in VM and change bus type"},
			Rule{Name: "windows-disk-bus", Path: disks, Valid: disks, Rule: "enum", Values: []string{"virtio", "sata", "scsi"},
				Message: "disk bus has to be either virtio or sata or scsi"},
			Rule{Name: "windows-cd-bus", Path: cds, Valid: cds, Rule: "enum", Values: []string{"sata"},
				Message: "cd bus has to be sata"})
	}
	if os.MinCores > 0 {
		c := int64(os.MinCores)
		out = append(out, Rule{Name: "minimal-required-cores", Path: "jsonpath::.spec.domain.cpu.cores", Rule: "integer",
			Message: "This VM requires more cores.", Min: &c})
	}
	return out
}

func vm(os OS, f Flavor, name string) map[string]any {
	validations, err := json.Marshal(rules(os))
	if err != nil {
		panic(fmt.Sprintf("templates: rules of %s do not encode: %v", os.Name, err))
	}
	hp := f.Workload == HighPerformance
	cores := os.Cores
	if cores == 0 {
		cores = 1
	}
	cpu := map[string]any{"sockets": f.Sockets, "cores": cores, "threads": 1}
	if hp {
		cpu["dedicatedCpuPlacement"] = true
		cpu["isolateEmulatorThread"] = true
	}
	domain := map[string]any{"cpu": cpu, "memory": map[string]any{"guest": f.Memory}}
	devices := map[string]any{}
	root := map[string]any{"name": "rootdisk", "disk": map[string]any{"bus": "virtio"}}
	volumes := []any{map[string]any{"name": "rootdisk", "dataVolume": map[string]any{"name": "${NAME}"}}}
	grace := 180
	if os.Windows {
		grace = 3600
		root["disk"] = map[string]any{"bus": os.DiskBus}
		devices["disks"] = []any{root}
		devices["interfaces"] = []any{map[string]any{"name": "default", "masquerade": map[string]any{}, "model": os.NICModel}}
		devices["inputs"] = []any{map[string]any{"type": "tablet", "bus": "usb", "name": "tablet"}}
		if hp {
			devices["networkInterfaceMultiqueue"] = true
		}
		domain["clock"] = map[string]any{"utc": map[string]any{}, "timer": map[string]any{
			"hpet": map[string]any{"present": false}, "pit": map[string]any{"tickPolicy": "delay"},
			"rtc": map[string]any{"tickPolicy": "catchup"}, "hyperv": map[string]any{}}}
		hv := map[string]any{"spinlocks": map[string]any{"spinlocks": 8191}, "synictimer": map[string]any{"direct": map[string]any{}}}
		for _, e := range []string{"relaxed", "vapic", "vpindex", "synic", "tlbflush", "frequencies", "reenlightenment", "ipi", "runtime", "reset"} {
			hv[e] = map[string]any{}
		}
		domain["features"] = map[string]any{"acpi": map[string]any{}, "apic": map[string]any{}, "smm": map[string]any{}, "hyperv": hv}
	} else {
		if hp {
			domain["ioThreadsPolicy"] = "shared"
			root["dedicatedIOThread"] = true
		}
		if os.Deprecated {
			root["bootOrder"] = 1
		}
		devices["rng"] = map[string]any{}
		devices["disks"] = []any{root, map[string]any{"name": "cloudinitdisk", "disk": map[string]any{"bus": "virtio"}}}
		devices["interfaces"] = []any{map[string]any{"name": "default", "masquerade": map[string]any{}, "model": "virtio"}}
		if f.Sockets > 1 {
			devices["networkInterfaceMultiqueue"] = true
		}
		if os.Transitional {
			devices["useVirtioTransitional"] = true
		}
		if f.Workload == Desktop || os.Name == "ubuntu" {
			devices["inputs"] = []any{map[string]any{"type": "tablet", "bus": "virtio", "name": "tablet"}}
		}
		if os.Firmware.EFI {
			domain["features"] = map[string]any{"smm": map[string]any{"enabled": true}}
		}
		volumes = append(volumes, map[string]any{"name": "cloudinitdisk", "cloudInitNoCloud": map[string]any{
			"userData": "#cloud-config\nuser: " + os.CloudUser + "\npassword: ${CLOUD_USER_PASSWORD}\nchpasswd: { expire: False }"}})
	}
	if fw := os.Firmware; fw.EFI {
		efi := map[string]any{}
		if fw.SecureBoot {
			efi["secureBoot"] = true
		}
		if fw.Persistent {
			efi["persistent"] = true
		}
		domain["firmware"] = map[string]any{"bootloader": map[string]any{"efi": efi}}
	}
	if os.Firmware.TPM {
		devices["tpm"] = map[string]any{"persistent": true}
	}
	domain["devices"] = devices
	return map[string]any{
		"apiVersion": "kubevirt.io/v1",
		"kind":       "VirtualMachine",
		"metadata": map[string]any{
			"name": "${NAME}",
			"labels": map[string]any{LabelVMTemplate: name, LabelVMTemplateVersion: Version,
				LabelVMTemplateRevision: "1", "app": "${NAME}"},
			"annotations": map[string]any{AnnValidations: string(validations)},
		},
		"spec": map[string]any{
			"runStrategy": "Halted",
			"dataVolumeTemplates": []any{map[string]any{
				"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
				"metadata": map[string]any{"name": "${NAME}"},
				"spec": map[string]any{
					"storage":   map[string]any{"resources": map[string]any{"requests": map[string]any{"storage": os.DiskSize}}},
					"sourceRef": map[string]any{"kind": "DataSource", "name": "${DATA_SOURCE_NAME}", "namespace": "${DATA_SOURCE_NAMESPACE}"},
				},
			}},
			"template": map[string]any{
				"metadata": map[string]any{
					"annotations": map[string]any{"vm.kubevirt.io/os": os.Name, "vm.kubevirt.io/workload": f.Workload, "vm.kubevirt.io/flavor": f.Name},
					"labels":      map[string]any{"kubevirt.io/domain": "${NAME}", "kubevirt.io/size": f.Name},
				},
				"spec": map[string]any{
					"architecture":                  Architecture,
					"domain":                        domain,
					"terminationGracePeriodSeconds": grace,
					"networks":                      []any{map[string]any{"name": "default", "pod": map[string]any{}}},
					"volumes":                       volumes,
				},
			},
		},
	}
}
