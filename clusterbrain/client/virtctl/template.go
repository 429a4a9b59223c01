package virtctl

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	kubevirtv1 "kubevirt.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// params collects repeated -p KEY=VALUE flags.
type params map[string]string

func (p params) String() string { return fmt.Sprint(map[string]string(p)) }

func (p params) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("parameter %q is not KEY=VALUE", s)
	}
	p[k] = v
	return nil
}

// ProcessTemplate fetches the template.openshift.io/v1 Template ref
// ("NAMESPACE/NAME", or NAME in the client's namespace), sets the given
// parameter values and has the server process it, as oc process does; it
// returns the resulting objects.
func (c *Client) ProcessTemplate(ctx context.Context, ref string, values map[string]string) ([]map[string]any, error) {
	ns, name, ok := strings.Cut(ref, "/")
	if !ok {
		ns, name = c.Namespace, ref
	}
	rc := c.Kube.CoreV1().RESTClient()
	base := "/apis/template.openshift.io/v1/namespaces/" + ns
	raw, err := rc.Get().AbsPath(base + "/templates/" + name).DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("get template %s/%s: %w", ns, name, err)
	}
	var tmpl map[string]any
	if err := json.Unmarshal(raw, &tmpl); err != nil {
		return nil, fmt.Errorf("template %s/%s: %w", ns, name, err)
	}
	left := map[string]string{}
	for k, v := range values {
		left[k] = v
	}
	ps, _ := tmpl["parameters"].([]any)
	for _, p := range ps {
		pm, _ := p.(map[string]any)
		if v, ok := left[fmt.Sprint(pm["name"])]; ok {
			pm["value"] = v
			delete(left, fmt.Sprint(pm["name"]))
		}
	}
	for k := range left {
		return nil, fmt.Errorf("template %s/%s has no parameter %q", ns, name, k)
	}
	body, err := json.Marshal(tmpl)
	if err != nil {
		return nil, err
	}
	// Processed in the client's namespace, as oc process does: users may
	// read the shared templates without writing where they live.
	raw, err = rc.Post().AbsPath("/apis/template.openshift.io/v1/namespaces/"+c.Namespace+"/processedtemplates").
		Body(body).SetHeader("Content-Type", "application/json").DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("process template %s/%s in %s: %w: %s", ns, name, c.Namespace, err, strings.TrimSpace(string(raw)))
	}
	var out struct {
		Objects []map[string]any `json:"objects"`
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		return nil, fmt.Errorf("processed template %s/%s: %w", ns, name, err)
	}
	return out.Objects, nil
}

// createFromTemplate prints the VM the template makes, or creates it in
// the client's namespace.
func (c *Client) createFromTemplate(ctx context.Context, o IO, ref, name string, values params, create bool) error {
	if name != "" {
		values["NAME"] = name
	}
	objs, err := c.ProcessTemplate(ctx, ref, values)
	if err != nil {
		return err
	}
	for _, obj := range objs {
		if !create {
			data, err := yaml.Marshal(obj)
			if err != nil {
				return err
			}
			if _, err := fmt.Fprintf(o.Out, "---\n%s", data); err != nil {
				return err
			}
			continue
		}
		if obj["kind"] != "VirtualMachine" {
			return fmt.Errorf("template %s makes a %v; only VirtualMachines are created", ref, obj["kind"])
		}
		data, err := json.Marshal(obj)
		if err != nil {
			return err
		}
		vm := &kubevirtv1.VirtualMachine{}
		if err := json.Unmarshal(data, vm); err != nil {
			return fmt.Errorf("template %s: %w", ref, err)
		}
		vm.Namespace = c.Namespace
		got, err := c.Virt.VMs.Create(ctx, vm)
		if err != nil {
			return fmt.Errorf("create vm %s: %w", vm.Name, err)
		}
		fmt.Fprintf(o.Out, "virtualmachine.kubevirt.io/%s created\n", got.Name)
	}
	return nil
}
