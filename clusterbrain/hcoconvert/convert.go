// Package hcoconvert converts HyperConverged objects between
// hco.kubevirt.io/v1beta1 (the stored version, which the brain reads) and
// hco.kubevirt.io/v1 (served beside it), and serves that conversion as the
// CRD's conversion webhook on the brain's webhook server.
//
// Conversion moves fields along one table of paths (v1beta1's flat spec ↔
// v1's grouped spec) and turns v1beta1's boolean feature gates into v1's
// list of named states and back. Nothing is lost on a round trip: what one
// version cannot express rides along in an annotation of the other —
// hco.kubevirt.io/v1-only-fields on a v1beta1 object (upstream HCO's name),
// nodevirt.io/v1beta1-only-fields on a v1 object — and is restored, then
// removed, when the object is converted back.
package hcoconvert

import (
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strings"

	hcov1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// Annotations carrying what the other version cannot express.
const (
	V1OnlyAnnotation      = "hco.kubevirt.io/v1-only-fields"
	V1beta1OnlyAnnotation = "nodevirt.io/v1beta1-only-fields"
)

// moves pairs a v1beta1 spec path with the v1 spec path holding the same
// value.
var moves = [][2]string{
	{"tuningPolicy", "virtualization.tuningPolicy"},
	{"liveMigrationConfig", "virtualization.liveMigrationConfig"},
	{"permittedHostDevices", "virtualization.permittedHostDevices"},
	{"workloadUpdateStrategy", "virtualization.workloadUpdateStrategy"},
	{"obsoleteCPUs.cpuModels", "virtualization.obsoleteCPUModels"},
	{"evictionStrategy", "virtualization.evictionStrategy"},
	{"virtualMachineOptions.disableFreePageReporting", "virtualization.virtualMachineOptions.disableFreePageReporting"},
	{"virtualMachineOptions.disableSerialConsoleLog", "virtualization.virtualMachineOptions.disableSerialConsoleLog"},
	{"defaultCPUModel", "virtualization.virtualMachineOptions.defaultCPUModel"},
	{"defaultRuntimeClass", "virtualization.virtualMachineOptions.defaultRuntimeClass"},
	{"higherWorkloadDensity", "virtualization.higherWorkloadDensity"},
	{"ksmConfiguration", "virtualization.ksmConfiguration"},
	{"liveUpdateConfiguration", "virtualization.liveUpdateConfiguration"},
	{"resourceRequirements.vmiCPUAllocationRatio", "virtualization.vmiCPUAllocationRatio"},
	{"resourceRequirements.autoCPULimitNamespaceLabelSelector", "virtualization.autoCPULimitNamespaceLabelSelector"},
	{"resourceRequirements.storageWorkloads", "storage.workloadResourceRequirements"},
	{"vmStateStorageClass", "storage.vmStateStorageClass"},
	{"scratchSpaceStorageClass", "storage.scratchSpaceStorageClass"},
	{"storageImport", "storage.storageImport"},
	{"filesystemOverhead", "storage.filesystemOverhead"},
	{"kubeSecondaryDNSNameServerIP", "networking.kubeSecondaryDNSNameServerIP"},
	{"kubeMacPoolConfiguration", "networking.kubeMacPoolConfiguration"},
	{"networkBinding", "networking.networkBinding"},
	{"commonTemplatesNamespace", "workloadSources.commonTemplatesNamespace"},
	{"commonBootImageNamespace", "workloadSources.commonBootImageNamespace"},
	{"enableCommonBootImageImport", "workloadSources.enableCommonBootImageImport"},
	{"featureGates.enableMultiArchBootImageImport", "workloadSources.enableMultiArchBootImageImport"},
	{"dataImportCronTemplates", "workloadSources.dataImportCronTemplates"},
	{"instancetypeConfig", "workloadSources.instancetypeConfig"},
	{"CommonInstancetypesDeployment", "workloadSources.commonInstancetypesDeployment"},
	{"certConfig", "security.certConfig"},
	{"tlsSecurityProfile", "security.tlsSecurityProfile"},
	{"infra.nodePlacement", "deployment.nodePlacements.infra"},
	{"workloads.nodePlacement", "deployment.nodePlacements.workload"},
	{"uninstallStrategy", "deployment.uninstallStrategy"},
	{"logVerbosityConfig", "deployment.logVerbosityConfig"},
	{"deployVmConsoleProxy", "deployment.deployVmConsoleProxy"},
	{"enableApplicationAwareQuota", "deployment.applicationAwareConfig.enable"},
}

// v1beta1Gates are the boolean feature gates v1beta1 has a field for.
var v1beta1Gates = func() map[string]bool {
	out := map[string]bool{}
	t := reflect.TypeOf(hcov1beta1.HyperConvergedFeatureGates{})
	for i := 0; i < t.NumField(); i++ {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		out[name] = true
	}
	return out
}()

// Object is a HyperConverged as decoded JSON.
type Object = map[string]any

// Convert returns obj (either version) converted to apiVersion.
func Convert(obj Object, apiVersion string) (Object, error) {
	from, _ := obj["apiVersion"].(string)
	switch {
	case from == apiVersion:
		return obj, nil
	case from == hcov1beta1.SchemeGroupVersion.String() && apiVersion == hcov1.SchemeGroupVersion.String():
		return ToV1(obj)
	case from == hcov1.SchemeGroupVersion.String() && apiVersion == hcov1beta1.SchemeGroupVersion.String():
		return ToV1beta1(obj)
	}
	return nil, fmt.Errorf("cannot convert %q to %q", from, apiVersion)
}

// ToV1 converts a v1beta1 HyperConverged to v1.
func ToV1(in Object) (Object, error) {
	out := deepCopy(in)
	out["apiVersion"] = hcov1.SchemeGroupVersion.String()
	src, _ := out["spec"].(map[string]any)
	if src == nil {
		src = map[string]any{}
	}
	dst, err := takeStash(out, V1OnlyAnnotation)
	if err != nil {
		return nil, err
	}
	stashedGates, _ := dst["featureGates"].([]any)
	delete(dst, "featureGates")
	for _, m := range moves {
		if v, ok := take(src, m[0]); ok {
			set(dst, m[1], v)
		}
	}
	// Boolean gates become named states; gates only v1 knows come back
	// from the stash, those v1beta1 also has follow v1beta1's value.
	gates, _ := src["featureGates"].(map[string]any)
	delete(src, "featureGates")
	var list []any
	for _, g := range stashedGates {
		if gm, ok := g.(map[string]any); ok && !v1beta1Gates[fmt.Sprint(gm["name"])] {
			list = append(list, gm)
		}
	}
	names := make([]string, 0, len(gates))
	for n := range gates {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		state := hcov1.Disabled
		if b, _ := gates[n].(bool); b {
			state = hcov1.Enabled
		}
		list = append(list, map[string]any{"name": n, "state": state})
	}
	if len(list) > 0 {
		dst["featureGates"] = list
	}
	if err := putStash(out, V1beta1OnlyAnnotation, src); err != nil {
		return nil, err
	}
	setSpec(out, dst)
	return out, nil
}

// ToV1beta1 converts a v1 HyperConverged to v1beta1.
func ToV1beta1(in Object) (Object, error) {
	out := deepCopy(in)
	out["apiVersion"] = hcov1beta1.SchemeGroupVersion.String()
	src, _ := out["spec"].(map[string]any)
	if src == nil {
		src = map[string]any{}
	}
	dst, err := takeStash(out, V1beta1OnlyAnnotation)
	if err != nil {
		return nil, err
	}
	// Gates v1beta1 has a field for become booleans (a missing state is
	// Enabled); the list itself stays in the stash so that gates only v1
	// knows survive.
	list, _ := src["featureGates"].([]any)
	delete(src, "featureGates")
	var only []any
	for _, g := range list {
		gm, ok := g.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("spec.featureGates: %v is not an object", g)
		}
		name, _ := gm["name"].(string)
		if !v1beta1Gates[name] {
			only = append(only, gm)
			continue
		}
		set(dst, "featureGates."+name, gm["state"] != hcov1.Disabled)
	}
	for _, m := range moves {
		if v, ok := take(src, m[1]); ok {
			set(dst, m[0], v)
		}
	}
	if len(only) > 0 {
		src["featureGates"] = only
	}
	if err := putStash(out, V1OnlyAnnotation, src); err != nil {
		return nil, err
	}
	setSpec(out, dst)
	return out, nil
}

func setSpec(obj Object, spec map[string]any) {
	if len(spec) == 0 {
		if _, had := obj["spec"]; !had {
			return
		}
	}
	obj["spec"] = spec
}

// takeStash removes annotation key from obj and returns the spec fields it
// carried (empty when absent).
func takeStash(obj Object, key string) (map[string]any, error) {
	md, _ := obj["metadata"].(map[string]any)
	ann, _ := md["annotations"].(map[string]any)
	raw, ok := ann[key].(string)
	if !ok {
		return map[string]any{}, nil
	}
	delete(ann, key)
	if len(ann) == 0 {
		delete(md, "annotations")
	}
	out := map[string]any{}
	if err := json.Unmarshal([]byte(raw), &out); err != nil {
		return nil, fmt.Errorf("annotation %s: %w", key, err)
	}
	return out, nil
}

// putStash records the spec fields the target version cannot express in
// annotation key (nothing when there are none).
func putStash(obj Object, key string, fields map[string]any) error {
	if len(fields) == 0 {
		return nil
	}
	data, err := json.Marshal(fields)
	if err != nil {
		return fmt.Errorf("annotation %s: %w", key, err)
	}
	md, _ := obj["metadata"].(map[string]any)
	if md == nil {
		md = map[string]any{}
		obj["metadata"] = md
	}
	ann, _ := md["annotations"].(map[string]any)
	if ann == nil {
		ann = map[string]any{}
		md["annotations"] = ann
	}
	ann[key] = string(data)
	return nil
}

// take removes the value at a dotted path, pruning parents it leaves
// empty.
func take(m map[string]any, path string) (any, bool) {
	head, rest, nested := strings.Cut(path, ".")
	v, ok := m[head]
	if !ok {
		return nil, false
	}
	if !nested {
		delete(m, head)
		return v, true
	}
	child, isMap := v.(map[string]any)
	if !isMap {
		return nil, false
	}
	got, ok := take(child, rest)
	if ok && len(child) == 0 {
		delete(m, head)
	}
	return got, ok
}

// set writes v at a dotted path, creating parents.
func set(m map[string]any, path string, v any) {
	head, rest, nested := strings.Cut(path, ".")
	if !nested {
		m[head] = v
		return
	}
	child, ok := m[head].(map[string]any)
	if !ok {
		child = map[string]any{}
		m[head] = child
	}
	set(child, rest, v)
}

func deepCopy(in Object) Object {
	data, err := json.Marshal(in)
	if err != nil {
		panic(fmt.Sprintf("hcoconvert: decoded JSON does not encode: %v", err))
	}
	var out Object
	if err := json.Unmarshal(data, &out); err != nil {
		panic(fmt.Sprintf("hcoconvert: %v", err))
	}
	return out
}
