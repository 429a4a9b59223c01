package tekton

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
)

func waitForVMIStatus(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	name := fs.String("vmiName", "", "name of the VMI")
	ns := fs.String("vmiNamespace", "", "namespace of the VMI (default: the active one)")
	success := fs.String("successCondition", "", `label selector over the VMI's fields, e.g. "status.phase == Succeeded"`)
	failure := fs.String("failureCondition", "", `label selector over the VMI's fields, e.g. "status.phase in (Failed, Unknown)"`)
	every := fs.Duration("poll", time.Second, "how often to look")
	return func(ctx context.Context, c *virtctl.Client, _ results) error {
		if *name == "" {
			return fmt.Errorf("vmiName %w", errMissing)
		}
		if *ns == "" {
			*ns = c.Namespace
		}
		ok, err := parseCondition("successCondition", *success)
		if err != nil {
			return err
		}
		bad, err := parseCondition("failureCondition", *failure)
		if err != nil {
			return err
		}
		for {
			vmi, err := c.Virt.VMIs.Get(ctx, *ns, *name)
			switch {
			case apierrors.IsNotFound(err):
			case err != nil:
				return fmt.Errorf("get vmi %s/%s: %w", *ns, *name, err)
			default:
				fields, err := flatten(vmi)
				if err != nil {
					return err
				}
				if bad != nil && bad.Matches(fields) {
					return fmt.Errorf("vmi %s/%s meets the failure condition %q", *ns, *name, *failure)
				}
				if ok == nil || ok.Matches(fields) {
					return nil
				}
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(*every):
			}
		}
	}
}

func parseCondition(name, expr string) (labels.Selector, error) {
	if expr == "" {
		return nil, nil
	}
	sel, err := labels.Parse(expr)
	if err != nil {
		return nil, fmt.Errorf("%s %q: %w", name, expr, err)
	}
	return sel, nil
}

// flatten turns an object's scalar fields into "a.b.c" → value (list items
// by index), the set conditions are matched against.
func flatten(obj any) (labels.Set, error) {
	data, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var v any
	if err := json.Unmarshal(data, &v); err != nil {
		return nil, err
	}
	out := labels.Set{}
	var walk func(prefix string, v any)
	walk = func(prefix string, v any) {
		switch t := v.(type) {
		case map[string]any:
			for k, e := range t {
				p := k
				if prefix != "" {
					p = prefix + "." + k
				}
				walk(p, e)
			}
		case []any:
			for i, e := range t {
				walk(fmt.Sprintf("%s.%d", prefix, i), e)
			}
		case nil:
		default:
			out[prefix] = fmt.Sprint(t)
		}
	}
	walk("", v)
	return out, nil
}
