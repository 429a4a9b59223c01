package admission

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strings"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
)

// rules returns the rule matching resource of kubevirt.io/v1 on ops.
func rules(resource string, ops ...admissionregistrationv1.OperationType) []admissionregistrationv1.RuleWithOperations {
	return []admissionregistrationv1.RuleWithOperations{{
		Operations: ops,
		Rule: admissionregistrationv1.Rule{APIGroups: []string{"kubevirt.io"}, APIVersions: []string{"v1"},
			Resources: []string{resource}},
	}}
}

// RegisterKubeVirt adds KubeVirt's own VM/VMI webhooks to s: VMI defaults,
// VM/VMI validation (with the KubeVirt CR's feature gates), VMI update
// restrictions and the namespace's LimitRange defaults and ResourceQuota
// for VMIs. The VMI defaulting and create validation are not called for the
// brain's own user, whose VM controller applies them in process
// (AdmitVMICreate); the LimitRange and quota webhooks are called for every
// VMI create, the brain's included.
func RegisterKubeVirt(s *Server) error {
	kv := &kubevirtWebhooks{cfg: newClusterConfig(s)}
	s.Register(Webhook{Name: VMIMutatorName, Path: "/virtualmachineinstances-mutate", Mutating: true,
		Rules: rules("virtualmachineinstances", admissionregistrationv1.Create), MatchConditions: notTheBrain(), Admit: kv.mutateVMI})
	s.Register(Webhook{Name: "virtualmachine-validator.kubevirt.io", Path: "/virtualmachines-validate",
		Rules: rules("virtualmachines", admissionregistrationv1.Create, admissionregistrationv1.Update), Admit: kv.admitVM})
	s.Register(Webhook{Name: VMIValidatorName, Path: "/virtualmachineinstances-validate-create",
		Rules: rules("virtualmachineinstances", admissionregistrationv1.Create), MatchConditions: notTheBrain(), Admit: kv.admitVMI})
	s.Register(Webhook{Name: VMIUpdateValidatorName, Path: "/virtualmachineinstances-validate-update",
		Rules: rules("virtualmachineinstances", admissionregistrationv1.Update), MatchConditions: notNodevirt(), Admit: admitVMIUpdate})
	registerQuota(s, kv.cfg)
	return nil
}

// kubevirtWebhooks are the VM/VMI webhooks that read the KubeVirt CR.
type kubevirtWebhooks struct {
	cfg *clusterConfig
}

func (k *kubevirtWebhooks) admitVM(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vm kubevirtv1.VirtualMachine
	if err := json.Unmarshal(req.Object.Raw, &vm); err != nil {
		return Denyf("decode virtualmachine: %v", err)
	}
	if req.Operation == admissionv1.Update && vm.DeletionTimestamp != nil {
		return Allow()
	}
	errs := ValidateVM(&vm)
	if vm.Spec.Instancetype != nil && vm.Spec.Template != nil {
		missing, err := k.cfg.instancetypeMissing(ctx, vm.Namespace, vm.Spec.Instancetype)
		if err != nil {
			return Denyf("look up instance type: %v", err)
		}
		// As KubeVirt: a VM naming an instance type not created yet is
		// admitted, and the VM controller reports the missing type on the VM.
		if !missing {
			errs = append(errs, instancetypeConflicts(field.NewPath("spec", "template", "spec", "domain"), &vm.Spec.Template.Spec.Domain)...)
		}
	}
	if t := vm.Spec.Template; t != nil {
		errs = append(errs, ValidateFeatureGates(field.NewPath("spec", "template", "spec"), &t.Spec, k.cfg.gates(ctx))...)
		// An update that leaves the model as it was is let through: the
		// VM already runs it or was admitted with it.
		if req.Operation == admissionv1.Create || !sameCPUModel(req.OldObject.Raw, t.Spec.Domain.CPU) {
			errs = append(errs, k.cfg.cpuModels(ctx).Check(field.NewPath("spec", "template", "spec"), &t.Spec)...)
		}
		// The VM controller copies the template's labels to the VMI it
		// creates as the brain: a user's template must not carry what the
		// user could not put on a VMI (a node binding).
		if !privileged(req.UserInfo) && len(reserved(t.ObjectMeta.Labels)) > 0 {
			errs = append(errs, field.Forbidden(field.NewPath("spec", "template", "metadata", "labels"), LabelsCreationMessage))
		}
	}
	if len(errs) > 0 {
		return DenyFields(errs)
	}
	return Allow()
}

func (k *kubevirtWebhooks) admitVMI(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vmi kubevirtv1.VirtualMachineInstance
	if err := json.Unmarshal(req.Object.Raw, &vmi); err != nil {
		return Denyf("decode virtualmachineinstance: %v", err)
	}
	spec := field.NewPath("spec")
	errs := ValidateVMISpec(spec, &vmi.Spec, false)
	errs = append(errs, ValidateFeatureGates(spec, &vmi.Spec, k.cfg.gates(ctx))...)
	errs = append(errs, k.cfg.cpuModels(ctx).Check(spec, &vmi.Spec)...)
	errs = append(errs, validateReservedLabels(&vmi, privileged(req.UserInfo))...)
	if len(errs) > 0 {
		return DenyFields(errs)
	}
	return Allow()
}

var runStrategies = map[kubevirtv1.VirtualMachineRunStrategy]bool{
	kubevirtv1.RunStrategyAlways: true, kubevirtv1.RunStrategyHalted: true, kubevirtv1.RunStrategyManual: true,
	kubevirtv1.RunStrategyRerunOnFailure: true, kubevirtv1.RunStrategyOnce: true, kubevirtv1.RunStrategyWaitAsReceiver: true,
}

// ValidateVM checks a VirtualMachine as KubeVirt's validator does, naming
// each offending field. What conflicts with an instance type is checked
// only once the type exists (admitVM).
func ValidateVM(vm *kubevirtv1.VirtualMachine) field.ErrorList {
	var errs field.ErrorList
	spec := field.NewPath("spec")
	if vm.Spec.Template == nil {
		return append(errs, field.Required(spec.Child("template"), "missing virtual machine template"))
	}
	if vm.Spec.Running != nil && vm.Spec.RunStrategy != nil {
		errs = append(errs, field.Invalid(spec.Child("running"), *vm.Spec.Running, "running and runStrategy are mutually exclusive"))
	}
	if rs := vm.Spec.RunStrategy; rs != nil && !runStrategies[*rs] {
		errs = append(errs, field.NotSupported(spec.Child("runStrategy"), *rs, []string{"Always", "Halted", "Manual", "RerunOnFailure", "Once"}))
	}
	withType := vm.Spec.Instancetype != nil
	errs = append(errs, ValidateVMISpec(spec.Child("template", "spec"), &vm.Spec.Template.Spec, withType)...)
	if it := vm.Spec.Instancetype; it != nil {
		errs = append(errs, validateMatcher(spec.Child("instancetype"), it.Name, it.Kind, "virtualmachineinstancetype", "virtualmachineclusterinstancetype")...)
	}
	if p := vm.Spec.Preference; p != nil {
		errs = append(errs, validateMatcher(spec.Child("preference"), p.Name, p.Kind, "virtualmachinepreference", "virtualmachineclusterpreference")...)
	}
	volumes := map[string]bool{}
	for _, v := range vm.Spec.Template.Spec.Volumes {
		if v.DataVolume != nil {
			volumes[v.DataVolume.Name] = true
		}
	}
	seen := map[string]bool{}
	for i, dvt := range vm.Spec.DataVolumeTemplates {
		p := spec.Child("dataVolumeTemplates").Index(i)
		switch {
		case dvt.Name == "":
			errs = append(errs, field.Required(p.Child("metadata", "name"), "dataVolumeTemplate needs a name"))
		case seen[dvt.Name]:
			errs = append(errs, field.Duplicate(p.Child("metadata", "name"), dvt.Name))
		case !volumes[dvt.Name]:
			errs = append(errs, field.Invalid(p.Child("metadata", "name"), dvt.Name,
				"dataVolumeTemplate must be referenced by a dataVolume volume of the template"))
		}
		seen[dvt.Name] = true
	}
	return errs
}

func validateMatcher(p *field.Path, name, kind string, namespaced, cluster string) field.ErrorList {
	var errs field.ErrorList
	if name == "" {
		errs = append(errs, field.Required(p.Child("name"), "a name is required"))
	}
	if k := strings.ToLower(kind); k != "" && k != namespaced && k != cluster {
		errs = append(errs, field.NotSupported(p.Child("kind"), kind, []string{namespaced, cluster}))
	}
	return errs
}

// instancetypeConflicts refuses what an instance type owns: vCPUs and
// guest memory.
func instancetypeConflicts(p *field.Path, d *kubevirtv1.DomainSpec) field.ErrorList {
	var errs field.ErrorList
	const msg = "VM field conflicts with selected instance type"
	if c := d.CPU; c != nil {
		if c.Sockets != 0 {
			errs = append(errs, field.Invalid(p.Child("cpu", "sockets"), c.Sockets, msg))
		}
		if c.Cores != 0 {
			errs = append(errs, field.Invalid(p.Child("cpu", "cores"), c.Cores, msg))
		}
		if c.Threads != 0 {
			errs = append(errs, field.Invalid(p.Child("cpu", "threads"), c.Threads, msg))
		}
	}
	if d.Memory != nil && d.Memory.Guest != nil {
		errs = append(errs, field.Invalid(p.Child("memory", "guest"), d.Memory.Guest.String(), msg))
	}
	if _, ok := d.Resources.Requests["memory"]; ok {
		errs = append(errs, field.Invalid(p.Child("resources", "requests", "memory"), d.Resources.Requests.Memory().String(), msg))
	}
	if _, ok := d.Resources.Requests["cpu"]; ok {
		errs = append(errs, field.Invalid(p.Child("resources", "requests", "cpu"), d.Resources.Requests.Cpu().String(), msg))
	}
	return errs
}

var minMemory = resource.MustParse("1Mi")

// ValidateVMISpec checks a VMI spec at path p. withInstancetype relaxes
// what an instance type provides (memory).
func ValidateVMISpec(p *field.Path, spec *kubevirtv1.VirtualMachineInstanceSpec, withInstancetype bool) field.ErrorList {
	var errs field.ErrorList
	dom := p.Child("domain")
	devs := dom.Child("devices")

	volumes := map[string]int{}
	for i, v := range spec.Volumes {
		vp := p.Child("volumes").Index(i)
		if msgs := validation.IsDNS1123Label(v.Name); len(msgs) > 0 {
			errs = append(errs, field.Invalid(vp.Child("name"), v.Name, strings.Join(msgs, "; ")))
		}
		if _, dup := volumes[v.Name]; dup {
			errs = append(errs, field.Duplicate(vp.Child("name"), v.Name))
		}
		volumes[v.Name] = i
		if n := countSources(v.VolumeSource); n != 1 {
			errs = append(errs, field.Invalid(vp, v.Name, fmt.Sprintf("volume must have exactly one source, has %d", n)))
		}
		if hd := v.HostDisk; hd != nil {
			errs = append(errs, validateHostDisk(vp.Child("hostDisk"), hd)...)
		}
	}
	disks := map[string]bool{}
	boot := map[uint]bool{}
	for i, d := range spec.Domain.Devices.Disks {
		dp := devs.Child("disks").Index(i)
		if d.Name == "" {
			errs = append(errs, field.Required(dp.Child("name"), "disk needs a name"))
			continue
		}
		if disks[d.Name] {
			errs = append(errs, field.Duplicate(dp.Child("name"), d.Name))
		}
		disks[d.Name] = true
		if _, ok := volumes[d.Name]; !ok {
			errs = append(errs, field.NotFound(dp.Child("name"), d.Name))
		}
		targets := 0
		for _, set := range []bool{d.Disk != nil, d.LUN != nil, d.CDRom != nil} {
			if set {
				targets++
			}
		}
		if targets > 1 {
			errs = append(errs, field.Invalid(dp, d.Name, "disk must have at most one of disk, lun or cdrom"))
		}
		if d.BootOrder != nil {
			if *d.BootOrder < 1 {
				errs = append(errs, field.Invalid(dp.Child("bootOrder"), *d.BootOrder, "must be greater than 0"))
			} else if boot[*d.BootOrder] {
				errs = append(errs, field.Duplicate(dp.Child("bootOrder"), *d.BootOrder))
			}
			boot[*d.BootOrder] = true
		}
	}

	networks := map[string]kubevirtv1.Network{}
	pods := 0
	for i, n := range spec.Networks {
		np := p.Child("networks").Index(i)
		if n.Name == "" {
			errs = append(errs, field.Required(np.Child("name"), "network needs a name"))
		}
		if _, dup := networks[n.Name]; dup {
			errs = append(errs, field.Duplicate(np.Child("name"), n.Name))
		}
		networks[n.Name] = n
		switch {
		case n.Pod != nil && n.Multus != nil, n.Pod == nil && n.Multus == nil:
			errs = append(errs, field.Invalid(np, n.Name, "network must have exactly one of pod or multus"))
		case n.Pod != nil:
			pods++
		case n.Multus.NetworkName == "":
			errs = append(errs, field.Required(np.Child("multus", "networkName"), "multus network needs a networkName"))
		}
	}
	if pods > 1 {
		errs = append(errs, field.TooMany(p.Child("networks"), pods, 1))
	}
	ifaces := map[string]bool{}
	for i, iface := range spec.Domain.Devices.Interfaces {
		ip := devs.Child("interfaces").Index(i)
		if ifaces[iface.Name] {
			errs = append(errs, field.Duplicate(ip.Child("name"), iface.Name))
		}
		ifaces[iface.Name] = true
		n, ok := networks[iface.Name]
		if !ok {
			errs = append(errs, field.NotFound(ip.Child("name"), iface.Name))
		}
		b := iface.InterfaceBindingMethod
		bindings := 0
		for _, set := range []bool{b.Bridge != nil, b.Masquerade != nil, b.SRIOV != nil, b.DeprecatedSlirp != nil,
			b.DeprecatedMacvtap != nil, b.DeprecatedPasst != nil, iface.Binding != nil} {
			if set {
				bindings++
			}
		}
		if bindings > 1 {
			errs = append(errs, field.Invalid(ip, iface.Name, "interface must have at most one binding method"))
		}
		if b.Masquerade != nil && ok && n.Pod == nil {
			errs = append(errs, field.Invalid(ip.Child("masquerade"), iface.Name, "masquerade is only allowed on the pod network"))
		}
		if iface.MacAddress != "" {
			if hw, err := net.ParseMAC(iface.MacAddress); err != nil || len(hw) != 6 {
				errs = append(errs, field.Invalid(ip.Child("macAddress"), iface.MacAddress, "must be a 48-bit MAC address"))
			} else if hw[0]&1 == 1 {
				errs = append(errs, field.Invalid(ip.Child("macAddress"), iface.MacAddress, "must be a unicast MAC address"))
			}
		}
	}
	for i, n := range spec.Networks {
		if !ifaces[n.Name] {
			errs = append(errs, field.Invalid(p.Child("networks").Index(i).Child("name"), n.Name, "network has no interface"))
		}
	}

	errs = append(errs, validateMemory(dom, &spec.Domain, withInstancetype)...)
	if c := spec.Domain.CPU; c != nil && c.MaxSockets != 0 && c.Sockets > c.MaxSockets {
		errs = append(errs, field.Invalid(dom.Child("cpu", "sockets"), c.Sockets, MaxSocketsMessage))
	}
	return errs
}

// MaxSocketsMessage is KubeVirt's refusal of more CPU sockets than the
// maxSockets CPU hotplug goes up to.
const MaxSocketsMessage = "Number of sockets in CPU topology is greater than the maximum sockets allowed"

// HostDiskGateMessage is KubeVirt's refusal of a hostDisk volume when the
// HostDisk feature gate is off.
const HostDiskGateMessage = "HostDisk feature gate is not enabled"

// ValidateFeatureGates refuses what spec (at path p) uses that a feature
// gate guards while enabled says the gate is off: hostDisk volumes without
// HostDisk, named on the volume as KubeVirt names them.
func ValidateFeatureGates(p *field.Path, spec *kubevirtv1.VirtualMachineInstanceSpec, enabled func(gate string) bool) field.ErrorList {
	var errs field.ErrorList
	for i, v := range spec.Volumes {
		if v.HostDisk != nil && !enabled(featuregate.HostDisk) {
			errs = append(errs, field.Forbidden(p.Child("volumes").Index(i), HostDiskGateMessage))
		}
	}
	return errs
}

// validateHostDisk checks a hostDisk's own fields as KubeVirt does. Where
// the path may lead on a node is the node agent's decision (nodeagent's
// hostdisk package), not admission's.
func validateHostDisk(p *field.Path, hd *kubevirtv1.HostDisk) field.ErrorList {
	var errs field.ErrorList
	if hd.Path == "" {
		errs = append(errs, field.Required(p.Child("path"), "path is required for hostDisk volume"))
	}
	switch hd.Type {
	case kubevirtv1.HostDiskExists:
		if !hd.Capacity.IsZero() {
			errs = append(errs, field.Invalid(p.Child("capacity"), hd.Capacity.String(),
				fmt.Sprintf("is allowed to pass only with type equal to '%s'", kubevirtv1.HostDiskExistsOrCreate)))
		}
	case kubevirtv1.HostDiskExistsOrCreate:
		if hd.Capacity.Sign() <= 0 {
			errs = append(errs, field.Invalid(p.Child("capacity"), hd.Capacity.String(), "must be positive for type DiskOrCreate"))
		}
	default:
		errs = append(errs, field.NotSupported(p.Child("type"), hd.Type,
			[]string{string(kubevirtv1.HostDiskExists), string(kubevirtv1.HostDiskExistsOrCreate)}))
	}
	return errs
}

func validateMemory(dom *field.Path, d *kubevirtv1.DomainSpec, withInstancetype bool) field.ErrorList {
	var errs field.ErrorList
	req, hasReq := d.Resources.Requests["memory"]
	lim, hasLim := d.Resources.Limits["memory"]
	var guest *resource.Quantity
	if d.Memory != nil {
		guest = d.Memory.Guest
	}
	if !hasReq && !hasLim && guest == nil && !withInstancetype {
		errs = append(errs, field.Required(dom.Child("resources", "requests", "memory"),
			"no memory requested, at least one of domain.memory.guest, resources.requests.memory or resources.limits.memory must be set"))
	}
	if hasReq && req.Cmp(minMemory) < 0 {
		errs = append(errs, field.Invalid(dom.Child("resources", "requests", "memory"), req.String(), "must be greater than or equal to 1Mi"))
	}
	if hasLim && lim.Cmp(minMemory) < 0 {
		errs = append(errs, field.Invalid(dom.Child("resources", "limits", "memory"), lim.String(), "must be greater than or equal to 1Mi"))
	}
	if guest != nil && guest.Cmp(minMemory) < 0 {
		errs = append(errs, field.Invalid(dom.Child("memory", "guest"), guest.String(), "must be greater than or equal to 1Mi"))
	}
	if hasReq && hasLim && lim.Cmp(req) < 0 {
		errs = append(errs, field.Invalid(dom.Child("resources", "limits", "memory"), lim.String(), "must be greater than or equal to the memory request"))
	}
	if guest != nil && hasLim && guest.Cmp(lim) > 0 {
		errs = append(errs, field.Invalid(dom.Child("memory", "guest"), guest.String(), "must not exceed the memory limit"))
	}
	return errs
}

func countSources(v kubevirtv1.VolumeSource) int {
	n := 0
	for _, set := range []bool{v.HostDisk != nil, v.PersistentVolumeClaim != nil, v.CloudInitNoCloud != nil,
		v.CloudInitConfigDrive != nil, v.Sysprep != nil, v.ContainerDisk != nil, v.Ephemeral != nil, v.EmptyDisk != nil,
		v.DataVolume != nil, v.ConfigMap != nil, v.Secret != nil, v.DownwardAPI != nil, v.ServiceAccount != nil,
		v.DownwardMetrics != nil, v.MemoryDump != nil} {
		if set {
			n++
		}
	}
	return n
}
