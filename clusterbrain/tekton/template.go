package tekton

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
)

var templateResource = schema.GroupVersionResource{Group: "template.openshift.io", Version: "v1", Resource: "templates"}

// commonTemplateKeys are the labels and annotations that make a template a
// common one; a copy drops them (upstream's copy-template does the same, so
// the copy is a user's template the SSP leaves alone).
var commonTemplateKeys = []string{
	templates.LabelVersion, "template.kubevirt.io/deprecated", templates.LabelDefaultVariant,
	"openshift.io/documentation-url", "openshift.io/provider-display-name", "openshift.io/support-url",
	"template.kubevirt.io/provider", "template.kubevirt.io/provider-support-level", "template.kubevirt.io/provider-url",
	"operator-sdk/primary-resource", "operator-sdk/primary-resource-type",
	"app.kubernetes.io/component", templates.LabelName, "app.kubernetes.io/part-of", "app.kubernetes.io/version",
	templates.LabelManagedBy,
}

// commonVMKeys are the template-derived labels and annotations of its VM.
var commonVMKeys = []string{
	"vm.kubevirt.io/flavor", "vm.kubevirt.io/os", "vm.kubevirt.io/workload", "kubevirt.io/domain", "kubevirt.io/size",
	templates.LabelVMTemplateRevision, templates.LabelVMTemplateVersion,
}

func templatesIn(c *virtctl.Client, ns string) (dynamic.ResourceInterface, error) {
	dyn, err := dynamic.NewForConfig(c.Config)
	if err != nil {
		return nil, err
	}
	return dyn.Resource(templateResource).Namespace(ns), nil
}

func stripCommon(m map[string]string) {
	for k := range m {
		if strings.HasPrefix(k, templates.LabelOSPrefix) || strings.HasPrefix(k, templates.LabelFlavorPrefix) ||
			strings.HasPrefix(k, templates.LabelWorkloadPrefix) {
			delete(m, k)
		}
	}
	for _, k := range commonTemplateKeys {
		delete(m, k)
	}
}

// vmObject returns the index and content of the template's VirtualMachine.
func vmObject(tmpl *unstructured.Unstructured) (int, map[string]any, error) {
	objs, _, _ := unstructured.NestedSlice(tmpl.Object, "objects")
	for i, o := range objs {
		m, ok := o.(map[string]any)
		if ok && m["kind"] == "VirtualMachine" {
			return i, m, nil
		}
	}
	return 0, nil, fmt.Errorf("template %s/%s has no VirtualMachine", tmpl.GetNamespace(), tmpl.GetName())
}

func setVMObject(tmpl *unstructured.Unstructured, i int, vm map[string]any) error {
	objs, _, _ := unstructured.NestedSlice(tmpl.Object, "objects")
	objs[i] = vm
	return unstructured.SetNestedSlice(tmpl.Object, objs, "objects")
}

// editStringMap applies edit to the string map at path, if there is one.
func editStringMap(obj map[string]any, edit func(map[string]string), path ...string) error {
	m, found, err := unstructured.NestedStringMap(obj, path...)
	if err != nil || !found {
		return err
	}
	edit(m)
	return unstructured.SetNestedStringMap(obj, m, path...)
}

func copyTemplate(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	srcName := fs.String("sourceTemplateName", "", "name of the template to copy")
	srcNS := fs.String("sourceTemplateNamespace", "", "its namespace (default: the active one)")
	dstName := fs.String("targetTemplateName", "", "name of the copy (default: generated from the source's)")
	dstNS := fs.String("targetTemplateNamespace", "", "namespace of the copy (default: the active one)")
	allowReplace := fs.String("allowReplace", "false", "true or false: replace a template of the same name")
	owner := ownerFlag(fs)
	return func(ctx context.Context, c *virtctl.Client, r results) error {
		for _, p := range []*string{srcName, srcNS, dstName, dstNS} {
			*p = strings.TrimSpace(*p)
		}
		if *srcName == "" {
			return fmt.Errorf("sourceTemplateName %w", errMissing)
		}
		replace, err := boolParam("allowReplace", *allowReplace)
		if err != nil {
			return err
		}
		defaultNS(c, srcNS, dstNS)
		src, err := templatesIn(c, *srcNS)
		if err != nil {
			return err
		}
		tmpl, err := src.Get(ctx, *srcName, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("get template %s/%s: %w", *srcNS, *srcName, err)
		}
		labels, ann := tmpl.GetLabels(), tmpl.GetAnnotations()
		if labels == nil {
			labels = map[string]string{}
		}
		if labels[templates.LabelType] == "base" {
			stripCommon(labels)
			stripCommon(ann)
			i, vm, err := vmObject(tmpl)
			if err != nil {
				return err
			}
			if vm["apiVersion"] != kubevirtv1.GroupVersion.String() {
				return fmt.Errorf("template %s/%s holds a VirtualMachine of %v, not %s", *srcNS, *srcName, vm["apiVersion"], kubevirtv1.GroupVersion)
			}
			strip := func(m map[string]string) {
				for _, k := range commonVMKeys {
					delete(m, k)
				}
			}
			steps := []struct {
				path []string
				add  map[string]string
			}{
				{[]string{"metadata", "labels"}, map[string]string{templates.LabelVMTemplate: *dstName}},
				{[]string{"metadata", "annotations"}, nil},
				{[]string{"spec", "template", "metadata", "labels"}, nil},
				{[]string{"spec", "template", "metadata", "annotations"}, nil},
			}
			for _, s := range steps {
				err := editStringMap(vm, func(m map[string]string) {
					strip(m)
					for k, v := range s.add {
						m[k] = v
					}
				}, s.path...)
				if err != nil {
					return fmt.Errorf("template %s/%s: %w", *srcNS, *srcName, err)
				}
			}
			if err := setVMObject(tmpl, i, vm); err != nil {
				return err
			}
		}
		labels[templates.LabelType] = "vm" // shown as a VM template in the UI
		md := map[string]any{"namespace": *dstNS}
		tmpl.Object["metadata"] = md
		tmpl.SetLabels(labels)
		tmpl.SetAnnotations(ann)
		if *dstName == "" {
			tmpl.SetGenerateName(*srcName)
		} else {
			tmpl.SetName(*dstName)
		}
		if err := owner.set(ctx, c, tmpl); err != nil {
			return err
		}
		dst, err := templatesIn(c, *dstNS)
		if err != nil {
			return err
		}
		got, err := createOrReplace(ctx, dst, tmpl, replace)
		if err != nil {
			return fmt.Errorf("copy template %s/%s to %s: %w", *srcNS, *srcName, *dstNS, err)
		}
		if err := r.set("name", got.GetName()); err != nil {
			return err
		}
		return r.set("namespace", got.GetNamespace())
	}
}

// createOrReplace creates obj; with replace, an object of its name is
// updated instead.
func createOrReplace(ctx context.Context, res dynamic.ResourceInterface, obj *unstructured.Unstructured, replace bool) (*unstructured.Unstructured, error) {
	if replace && obj.GetName() != "" {
		old, err := res.Get(ctx, obj.GetName(), metav1.GetOptions{})
		switch {
		case err == nil:
			obj.SetResourceVersion(old.GetResourceVersion())
			return res.Update(ctx, obj, metav1.UpdateOptions{})
		case !apierrors.IsNotFound(err):
			return nil, err
		}
	}
	return res.Create(ctx, obj, metav1.CreateOptions{})
}

// defaultNS sets each empty namespace to the active one.
func defaultNS(c *virtctl.Client, nss ...*string) {
	for _, ns := range nss {
		if *ns == "" {
			*ns = c.Namespace
		}
	}
}

// keyValues parses KEY:VALUE items: the key ends at the first colon
// (label and annotation keys hold none, values may), spaces around both
// trimmed.
func keyValues(name string, items []string) (map[string]string, error) {
	out := map[string]string{}
	for _, it := range items {
		k, v, ok := strings.Cut(it, ":")
		k = strings.TrimSpace(k)
		if !ok || k == "" {
			return nil, fmt.Errorf("%s: %q is not KEY:VALUE", name, it)
		}
		out[k] = strings.TrimSpace(v)
	}
	return out, nil
}

// jsonItems decodes each item into a fresh T.
func jsonItems[T any](name string, items []string) ([]T, error) {
	out := make([]T, 0, len(items))
	for _, it := range items {
		var v T
		if err := json.Unmarshal([]byte(it), &v); err != nil {
			return nil, fmt.Errorf("%s: %q: %w", name, it, err)
		}
		out = append(out, v)
	}
	return out, nil
}

// replaceByName replaces the item of the same name, else appends.
func replaceByName[T any](list []T, add []T, name func(T) string) []T {
	for _, a := range add {
		replaced := false
		for i := range list {
			if name(list[i]) == name(a) {
				list[i], replaced = a, true
			}
		}
		if !replaced {
			list = append(list, a)
		}
	}
	return list
}

type templateEdit struct {
	sockets, cores, threads            uint32
	memory                             *resource.Quantity
	tmplLabels, tmplAnn, vmLabels      map[string]string
	vmAnn                              map[string]string
	disks                              []kubevirtv1.Disk
	volumes                            []kubevirtv1.Volume
	dvTemplates                        []kubevirtv1.DataVolumeTemplateSpec
	params                             []map[string]any
	delDisks, delVolumes, delDVs, delP bool
}

func modifyVMTemplate(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	name := fs.String("templateName", "", "name of the template")
	ns := fs.String("templateNamespace", "", "its namespace (default: the active one)")
	sockets := fs.String("cpuSockets", "", "CPU sockets of the VM (0: unchanged)")
	cores := fs.String("cpuCores", "", "CPU cores of the VM (0: unchanged)")
	threads := fs.String("cpuThreads", "", "CPU threads of the VM (0: unchanged)")
	memory := fs.String("memory", "", "memory of the VM, e.g. 2Gi")
	var tmplLabels, tmplAnn, vmLabels, vmAnn, disks, volumes, dvTemplates, params multi
	fs.Var(&tmplLabels, "templateLabels", "template label KEY:VALUE, replaced if present (repeatable)")
	fs.Var(&tmplAnn, "templateAnnotations", "template annotation KEY:VALUE (repeatable)")
	fs.Var(&vmLabels, "vmLabels", "VM label KEY:VALUE (repeatable)")
	fs.Var(&vmAnn, "vmAnnotations", "VM annotation KEY:VALUE (repeatable)")
	fs.Var(&disks, "disks", "VM disk as JSON, replacing the disk of its name, else appended (repeatable)")
	fs.Var(&volumes, "volumes", "VM volume as JSON, replacing the volume of its name, else appended (repeatable)")
	fs.Var(&dvTemplates, "datavolumeTemplates", "DataVolume template as JSON, replacing the one of its name, else appended (repeatable)")
	fs.Var(&params, "templateParameters", "template parameter as JSON, replacing the one of its name, else appended (repeatable)")
	delDisks := fs.String("deleteDisks", "false", "true or false: delete the VM's disks before adding --disks")
	delVolumes := fs.String("deleteVolumes", "false", "true or false: delete the VM's volumes before adding --volumes")
	delDVs := fs.String("deleteDatavolumeTemplate", "false", "true or false: delete the DataVolume templates, with their volumes and disks")
	delParams := fs.String("deleteTemplateParameters", "false", "true or false: delete the template's parameters before adding --templateParameters")
	delTemplate := fs.String("deleteTemplate", "false", "true or false: delete the template (every other parameter is ignored)")
	return func(ctx context.Context, c *virtctl.Client, r results) error {
		*name, *ns = strings.TrimSpace(*name), strings.TrimSpace(*ns)
		if *name == "" {
			return fmt.Errorf("templateName %w", errMissing)
		}
		defaultNS(c, ns)
		var e templateEdit
		var err error
		for _, n := range []struct {
			flag, v string
			to      *uint32
		}{{"cpuSockets", *sockets, &e.sockets}, {"cpuCores", *cores, &e.cores}, {"cpuThreads", *threads, &e.threads}} {
			if n.v == "" {
				continue
			}
			u, err := strconv.ParseUint(n.v, 0, 32)
			if err != nil {
				return fmt.Errorf("%s: %q is not a count", n.flag, n.v)
			}
			*n.to = uint32(u)
		}
		if *memory != "" {
			q, err := resource.ParseQuantity(*memory)
			if err != nil {
				return fmt.Errorf("memory: %w", err)
			}
			e.memory = &q
		}
		for _, kv := range []struct {
			flag  string
			items multi
			to    *map[string]string
		}{{"templateLabels", tmplLabels, &e.tmplLabels}, {"templateAnnotations", tmplAnn, &e.tmplAnn},
			{"vmLabels", vmLabels, &e.vmLabels}, {"vmAnnotations", vmAnn, &e.vmAnn}} {
			if *kv.to, err = keyValues(kv.flag, kv.items); err != nil {
				return err
			}
		}
		if e.disks, err = jsonItems[kubevirtv1.Disk]("disks", disks); err != nil {
			return err
		}
		if e.volumes, err = jsonItems[kubevirtv1.Volume]("volumes", volumes); err != nil {
			return err
		}
		if e.dvTemplates, err = jsonItems[kubevirtv1.DataVolumeTemplateSpec]("datavolumeTemplates", dvTemplates); err != nil {
			return err
		}
		if e.params, err = jsonItems[map[string]any]("templateParameters", params); err != nil {
			return err
		}
		for _, p := range e.params {
			if s, _ := p["name"].(string); s == "" {
				return fmt.Errorf("templateParameters: a parameter without a name")
			}
		}
		for _, b := range []struct {
			flag, v string
			to      *bool
		}{{"deleteDisks", *delDisks, &e.delDisks}, {"deleteVolumes", *delVolumes, &e.delVolumes},
			{"deleteDatavolumeTemplate", *delDVs, &e.delDVs}, {"deleteTemplateParameters", *delParams, &e.delP}} {
			if *b.to, err = boolParam(b.flag, b.v); err != nil {
				return err
			}
		}
		deleteIt, err := boolParam("deleteTemplate", *delTemplate)
		if err != nil {
			return err
		}
		res, err := templatesIn(c, *ns)
		if err != nil {
			return err
		}
		tmpl, err := res.Get(ctx, *name, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("get template %s/%s: %w", *ns, *name, err)
		}
		if deleteIt {
			if err := res.Delete(ctx, *name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete template %s/%s: %w", *ns, *name, err)
			}
		} else {
			if err := e.apply(tmpl); err != nil {
				return fmt.Errorf("template %s/%s: %w", *ns, *name, err)
			}
			patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": tmpl.GetLabels(), "annotations": tmpl.GetAnnotations()},
				"objects": tmpl.Object["objects"], "parameters": tmpl.Object["parameters"]})
			if err != nil {
				return err
			}
			if tmpl, err = res.Patch(ctx, *name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
				return fmt.Errorf("patch template %s/%s: %w", *ns, *name, err)
			}
		}
		if err := r.set("name", tmpl.GetName()); err != nil {
			return err
		}
		return r.set("namespace", tmpl.GetNamespace())
	}
}

func mergeInto(m map[string]string, add map[string]string) map[string]string {
	if m == nil && len(add) > 0 {
		m = map[string]string{}
	}
	for k, v := range add {
		m[k] = v
	}
	return m
}

// apply edits the template and its VirtualMachine.
func (e *templateEdit) apply(tmpl *unstructured.Unstructured) error {
	tmpl.SetLabels(mergeInto(tmpl.GetLabels(), e.tmplLabels))
	tmpl.SetAnnotations(mergeInto(tmpl.GetAnnotations(), e.tmplAnn))
	var params []any
	if !e.delP {
		params, _, _ = unstructured.NestedSlice(tmpl.Object, "parameters")
	}
	for _, p := range e.params {
		replaced := false
		for i, old := range params {
			if om, _ := old.(map[string]any); om != nil && om["name"] == p["name"] {
				params[i], replaced = p, true
			}
		}
		if !replaced {
			params = append(params, p)
		}
	}
	if params == nil {
		params = []any{} // a null would remove them in the merge patch
	}
	tmpl.Object["parameters"] = params
	i, raw, err := vmObject(tmpl)
	if err != nil {
		return err
	}
	data, err := json.Marshal(raw)
	if err != nil {
		return err
	}
	vm := &kubevirtv1.VirtualMachine{}
	if err := json.Unmarshal(data, vm); err != nil {
		return fmt.Errorf("its VirtualMachine: %w", err)
	}
	e.applyVM(vm)
	out, err := json.Marshal(vm)
	if err != nil {
		return err
	}
	var m map[string]any
	if err := json.Unmarshal(out, &m); err != nil {
		return err
	}
	delete(m, "status")
	if md, _ := m["metadata"].(map[string]any); md != nil && md["creationTimestamp"] == nil {
		delete(md, "creationTimestamp")
	}
	return setVMObject(tmpl, i, m)
}

func (e *templateEdit) applyVM(vm *kubevirtv1.VirtualMachine) {
	vm.Labels = mergeInto(vm.Labels, e.vmLabels)
	vm.Annotations = mergeInto(vm.Annotations, e.vmAnn)
	if vm.Spec.Template == nil {
		vm.Spec.Template = &kubevirtv1.VirtualMachineInstanceTemplateSpec{}
	}
	spec := &vm.Spec.Template.Spec
	if e.sockets > 0 || e.cores > 0 || e.threads > 0 {
		if spec.Domain.CPU == nil {
			spec.Domain.CPU = &kubevirtv1.CPU{}
		}
		for _, n := range []struct {
			v  uint32
			to *uint32
		}{{e.sockets, &spec.Domain.CPU.Sockets}, {e.cores, &spec.Domain.CPU.Cores}, {e.threads, &spec.Domain.CPU.Threads}} {
			if n.v > 0 {
				*n.to = n.v
			}
		}
	}
	if e.memory != nil {
		// The guest's memory is where the template sets it: memory.guest
		// (the common templates), else the memory request.
		_, requested := spec.Domain.Resources.Requests[corev1.ResourceMemory]
		if spec.Domain.Memory != nil && spec.Domain.Memory.Guest != nil || !requested {
			if spec.Domain.Memory == nil {
				spec.Domain.Memory = &kubevirtv1.Memory{}
			}
			spec.Domain.Memory.Guest = e.memory
		}
		if requested {
			spec.Domain.Resources.Requests[corev1.ResourceMemory] = *e.memory
		}
	}
	if e.delDisks {
		spec.Domain.Devices.Disks = nil
	}
	if e.delVolumes {
		spec.Volumes = nil
	}
	if e.delDVs {
		// The DataVolume templates go, with the volumes that use them and
		// those volumes' disks.
		dvs := map[string]bool{}
		for _, t := range vm.Spec.DataVolumeTemplates {
			dvs[t.Name] = true
		}
		gone := map[string]bool{}
		var volumes []kubevirtv1.Volume
		for _, v := range spec.Volumes {
			if v.DataVolume != nil && dvs[v.DataVolume.Name] {
				gone[v.Name] = true
				continue
			}
			volumes = append(volumes, v)
		}
		var disks []kubevirtv1.Disk
		for _, d := range spec.Domain.Devices.Disks {
			if !gone[d.Name] {
				disks = append(disks, d)
			}
		}
		spec.Volumes, spec.Domain.Devices.Disks, vm.Spec.DataVolumeTemplates = volumes, disks, nil
	}
	vm.Spec.DataVolumeTemplates = replaceByName(vm.Spec.DataVolumeTemplates, e.dvTemplates, func(t kubevirtv1.DataVolumeTemplateSpec) string { return t.Name })
	spec.Domain.Devices.Disks = replaceByName(spec.Domain.Devices.Disks, e.disks, func(d kubevirtv1.Disk) string { return d.Name })
	spec.Volumes = replaceByName(spec.Volumes, e.volumes, func(v kubevirtv1.Volume) string { return v.Name })
}
