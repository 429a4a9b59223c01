package tekton

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
)

// create makes vm in ns (else its own, else the client's), applying
// startVM and runStrategy, and writes the name and namespace results.
func create(ctx context.Context, c *virtctl.Client, r results, vm *kubevirtv1.VirtualMachine, ns, startVM, runStrategy string) error {
	switch {
	case ns != "":
		vm.Namespace = ns
	case vm.Namespace == "":
		vm.Namespace = c.Namespace
	}
	start, err := boolParam("startVM", startVM)
	if err != nil {
		return err
	}
	switch {
	case runStrategy != "":
		rs := kubevirtv1.VirtualMachineRunStrategy(runStrategy)
		vm.Spec.RunStrategy, vm.Spec.Running = &rs, nil
	case startVM != "":
		rs := kubevirtv1.RunStrategyHalted
		if start {
			rs = kubevirtv1.RunStrategyAlways
		}
		if vm.Spec.RunStrategy == nil || *vm.Spec.RunStrategy != kubevirtv1.RunStrategyAlways {
			vm.Spec.RunStrategy, vm.Spec.Running = &rs, nil
		}
	}
	got, err := c.Virt.VMs.Create(ctx, vm)
	if err != nil {
		return fmt.Errorf("create vm %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	if err := r.set("name", got.Name); err != nil {
		return err
	}
	return r.set("namespace", got.Namespace)
}

func createFromManifest(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	manifest := fs.String("manifest", "", "YAML manifest of the VirtualMachine")
	ns := fs.String("namespace", "", "namespace of the VM (default: the manifest's, else the active one)")
	startVM := fs.String("startVM", "", "true or false: start the VM after creation")
	runStrategy := fs.String("runStrategy", "", "runStrategy of the VM (replaces spec.running)")
	return func(ctx context.Context, c *virtctl.Client, r results) error {
		if *manifest == "" {
			return fmt.Errorf("manifest %w", errMissing)
		}
		vm := &kubevirtv1.VirtualMachine{}
		if err := yaml.UnmarshalStrict([]byte(*manifest), vm); err != nil {
			return fmt.Errorf("manifest: %w", err)
		}
		if vm.Kind != "" && vm.Kind != "VirtualMachine" {
			return fmt.Errorf("manifest is a %s, not a VirtualMachine", vm.Kind)
		}
		if vm.Name == "" && vm.GenerateName == "" {
			return fmt.Errorf("manifest: metadata.name %w", errMissing)
		}
		return create(ctx, c, r, vm, *ns, *startVM, *runStrategy)
	}
}

func createFromTemplate(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	name := fs.String("templateName", "", "name of the template")
	tns := fs.String("templateNamespace", "", "namespace of the template (default: the active one)")
	var params multi
	fs.Var(&params, "templateParams", "template parameter KEY:VALUE (repeatable)")
	vmNS := fs.String("vmNamespace", "", "namespace of the VM (default: the active one)")
	startVM := fs.String("startVM", "", "true or false: start the VM after creation")
	runStrategy := fs.String("runStrategy", "", "runStrategy of the VM")
	return func(ctx context.Context, c *virtctl.Client, r results) error {
		if *name == "" {
			return fmt.Errorf("templateName %w", errMissing)
		}
		values := map[string]string{}
		for _, p := range params {
			k, v, ok := strings.Cut(p, ":")
			if !ok || k == "" {
				return fmt.Errorf("templateParams: %q is not KEY:VALUE", p)
			}
			values[k] = v
		}
		ref := *name
		if *tns != "" {
			ref = *tns + "/" + *name
		}
		processNS := *vmNS
		if processNS == "" {
			processNS = c.Namespace
		}
		pc := *c
		pc.Namespace = processNS
		objs, err := pc.ProcessTemplate(ctx, ref, values)
		if err != nil {
			return err
		}
		for _, o := range objs {
			if o["kind"] != "VirtualMachine" {
				continue
			}
			data, err := json.Marshal(o)
			if err != nil {
				return err
			}
			vm := &kubevirtv1.VirtualMachine{}
			if err := json.Unmarshal(data, vm); err != nil {
				return fmt.Errorf("template %s: %w", ref, err)
			}
			return create(ctx, c, r, vm, processNS, *startVM, *runStrategy)
		}
		return fmt.Errorf("template %s makes no VirtualMachine", ref)
	}
}

func cleanupVM(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	name := fs.String("vmName", "", "name of the VM")
	ns := fs.String("vmNamespace", "", "namespace of the VM (default: the active one)")
	stop := fs.String("stop", "true", "stop the VM (and wait until its VMI is gone)")
	del := fs.String("delete", "false", "delete the VM (and wait until it is gone)")
	timeout := fs.Duration("timeout", 30*time.Minute, "how long to wait")
	return func(ctx context.Context, c *virtctl.Client, _ results) error {
		if *name == "" {
			return fmt.Errorf("vmName %w", errMissing)
		}
		if *ns == "" {
			*ns = c.Namespace
		}
		doStop, err := boolParam("stop", *stop)
		if err != nil {
			return err
		}
		doDelete, err := boolParam("delete", *del)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		if doStop {
			patch := []byte(`{"spec":{"runStrategy":"Halted","running":null}}`)
			if _, err := c.Virt.VMs.Patch(ctx, *ns, *name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
				return fmt.Errorf("stop vm %s/%s: %w", *ns, *name, err)
			}
			if err := waitGone(ctx, func() error { _, err := c.Virt.VMIs.Get(ctx, *ns, *name); return err }); err != nil {
				return fmt.Errorf("vmi %s/%s did not stop: %w", *ns, *name, err)
			}
		}
		if doDelete {
			if err := c.Virt.VMs.Delete(ctx, *ns, *name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete vm %s/%s: %w", *ns, *name, err)
			}
			if err := waitGone(ctx, func() error { _, err := c.Virt.VMs.Get(ctx, *ns, *name); return err }); err != nil {
				return fmt.Errorf("vm %s/%s not deleted: %w", *ns, *name, err)
			}
		}
		return nil
	}
}

func waitGone(ctx context.Context, get func() error) error {
	for {
		err := get()
		if apierrors.IsNotFound(err) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}
