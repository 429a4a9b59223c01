// Package validator is SSP's template validator: a VM made from a template
// is checked against the validation rules of its vm.kubevirt.io/validations
// annotation, or of its template's "validations" annotation (found through
// the vm.kubevirt.io/template and vm.kubevirt.io/template.namespace
// labels). Rules (integer, string, enum, regex) refuse the VM with one
// cause per broken rule, or only warn when justWarning is set.
package validator

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/jsonpath"
)

// Rule kinds.
const (
	Integer = "integer"
	String  = "string"
	Enum    = "enum"
	Regex   = "regex"
)

const pathPrefix = "jsonpath::"

// Rule is one validation rule. Min and Max (and MinLength, MaxLength) are
// numbers, quantities ("2Gi") or "jsonpath::" paths into the VM.
type Rule struct {
	Name        string          `json:"name"`
	Path        string          `json:"path"`
	Valid       string          `json:"valid,omitempty"`
	Rule        string          `json:"rule"`
	Message     string          `json:"message"`
	Min         json.RawMessage `json:"min,omitempty"`
	Max         json.RawMessage `json:"max,omitempty"`
	MinLength   json.RawMessage `json:"minLength,omitempty"`
	MaxLength   json.RawMessage `json:"maxLength,omitempty"`
	Regex       string          `json:"regex,omitempty"`
	Values      []string        `json:"values,omitempty"`
	JustWarning bool            `json:"justWarning,omitempty"`
}

// ParseRules decodes a validations annotation.
func ParseRules(data string) ([]Rule, error) {
	if strings.TrimSpace(data) == "" {
		return nil, nil
	}
	var rules []Rule
	if err := json.Unmarshal([]byte(data), &rules); err != nil {
		return nil, fmt.Errorf("validation rules: %w", err)
	}
	return rules, nil
}

// Outcome is what evaluating the rules on one VM found.
type Outcome struct {
	// Causes are the broken rules that refuse the VM.
	Causes []metav1.StatusCause
	// Warnings are the broken justWarning rules.
	Warnings []string
}

// Evaluate checks vm (decoded JSON) against rules. A malformed rule is a
// cause too, as upstream reports it.
func Evaluate(rules []Rule, vm map[string]any) Outcome {
	var out Outcome
	seen := map[string]bool{}
	for i := range rules {
		r := &rules[i]
		field := strings.TrimPrefix(strings.TrimPrefix(r.Path, pathPrefix), "$")
		fail := func(msg string) {
			if r.JustWarning {
				out.Warnings = append(out.Warnings, r.Message+": "+msg)
				return
			}
			out.Causes = append(out.Causes, metav1.StatusCause{Type: metav1.CauseTypeFieldValueInvalid, Field: field,
				Message: r.Message + ": " + msg})
		}
		switch {
		case seen[r.Name]:
			fail("duplicate Rule Name")
			continue
		case r.Message == "":
			fail("missing required key")
			continue
		}
		seen[r.Name] = true
		if r.Valid != "" {
			vals, err := find(vm, r.Valid)
			if err != nil || len(vals) == 0 {
				continue // not applicable: the valid path does not exist
			}
		}
		vals, err := find(vm, r.Path)
		if err != nil {
			fail(err.Error())
			continue
		}
		ok, text, err := apply(r, vm, vals)
		switch {
		case err != nil:
			fail(err.Error())
		case !ok:
			fail(text)
		}
	}
	return out
}

// find evaluates a "jsonpath::" path relative to the VM's
// spec.template, as upstream's validator does.
func find(vm map[string]any, p string) ([]any, error) {
	if !strings.HasPrefix(p, pathPrefix) {
		return nil, fmt.Errorf("invalid JSONPath %q", p)
	}
	expr := strings.TrimPrefix(strings.TrimPrefix(p, pathPrefix), "$")
	jp := jsonpath.New("rule").AllowMissingKeys(true)
	if err := jp.Parse("{.spec.template" + expr + "}"); err != nil {
		return nil, fmt.Errorf("invalid JSONPath %q: %w", p, err)
	}
	res, err := jp.FindResults(vm)
	if err != nil {
		return nil, fmt.Errorf("invalid JSONPath %q: %w", p, err)
	}
	var out []any
	for _, r := range res {
		for _, v := range r {
			if v.IsValid() && v.CanInterface() && v.Interface() != nil {
				out = append(out, v.Interface())
			}
		}
	}
	return out, nil
}

// cpuDefaults are the values KubeVirt assumes for missing CPU topology.
var cpuDefaults = map[string]int64{".spec.domain.cpu.cores": 1, ".spec.domain.cpu.sockets": 1, ".spec.domain.cpu.threads": 1}

func apply(r *Rule, vm map[string]any, vals []any) (bool, string, error) {
	switch r.Rule {
	case Integer:
		ints, err := toInts(vals)
		if err != nil {
			return false, "", err
		}
		if len(ints) == 0 {
			if d, ok := cpuDefaults[strings.TrimPrefix(strings.TrimPrefix(r.Path, pathPrefix), "$")]; ok {
				ints = []int64{d}
			}
		}
		min, hasMin, err := bound(r.Min, vm)
		if err != nil {
			return false, "", err
		}
		max, hasMax, err := bound(r.Max, vm)
		if err != nil {
			return false, "", err
		}
		var msgs []string
		for _, v := range ints {
			if hasMin && v < min {
				msgs = append(msgs, fmt.Sprintf("value %d is lower than minimum [%d]", v, min))
			}
			if hasMax && v > max {
				msgs = append(msgs, fmt.Sprintf("value %d is higher than maximum [%d]", v, max))
			}
		}
		return len(msgs) == 0, strings.Join(msgs, ", "), nil
	case String:
		strs := toStrings(vals)
		min, hasMin, err := bound(r.MinLength, vm)
		if err != nil {
			return false, "", err
		}
		max, hasMax, err := bound(r.MaxLength, vm)
		if err != nil {
			return false, "", err
		}
		for _, s := range strs {
			if hasMin && int64(len(s)) < min || hasMax && int64(len(s)) > max {
				return false, fmt.Sprintf("length of %q is not in interval [%s, %s]", s, bstr(hasMin, min), bstr(hasMax, max)), nil
			}
		}
		return true, "", nil
	case Enum:
		strs := toStrings(vals)
		allowed := map[string]bool{}
		for _, v := range r.Values {
			allowed[v] = true
		}
		for _, s := range strs {
			if !allowed[s] {
				return false, fmt.Sprintf("Some of [%s] are not in [%s]", strings.Join(strs, ", "), strings.Join(r.Values, ", ")), nil
			}
		}
		return true, "", nil
	case Regex:
		re, err := regexp.Compile(r.Regex)
		if err != nil {
			return false, "", fmt.Errorf("regex %q: %w", r.Regex, err)
		}
		strs := toStrings(vals)
		for _, s := range strs {
			if !re.MatchString(s) {
				return false, fmt.Sprintf("Some of [%s] do not match %s", strings.Join(strs, ", "), r.Regex), nil
			}
		}
		return true, "", nil
	}
	return false, "", errors.New("unrecognized Rule type")
}

func bstr(has bool, v int64) string {
	if !has {
		return "-"
	}
	return strconv.FormatInt(v, 10)
}

// bound decodes a min/max: a number, a quantity string or a path.
func bound(raw json.RawMessage, vm map[string]any) (int64, bool, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return 0, false, nil
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return 0, false, err
	}
	if s, ok := v.(string); ok && strings.HasPrefix(s, pathPrefix) {
		vals, err := find(vm, s)
		if err != nil {
			return 0, false, err
		}
		ints, err := toInts(vals)
		if err != nil {
			return 0, false, err
		}
		if len(ints) != 1 {
			return 0, false, fmt.Errorf("expected one value at %s, found %d", s, len(ints))
		}
		return ints[0], true, nil
	}
	ints, err := toInts([]any{v})
	if err != nil {
		return 0, false, err
	}
	return ints[0], true, nil
}

func toInts(vals []any) ([]int64, error) {
	var out []int64
	for _, v := range vals {
		switch t := v.(type) {
		case float64:
			out = append(out, int64(t))
		case int64:
			out = append(out, t)
		case int:
			out = append(out, int64(t))
		case json.Number:
			n, err := t.Int64()
			if err != nil {
				return nil, err
			}
			out = append(out, n)
		case string:
			q, err := resource.ParseQuantity(t)
			if err != nil {
				return nil, fmt.Errorf("value %q is not an integer or a quantity", t)
			}
			out = append(out, q.Value())
		default:
			return nil, fmt.Errorf("value %v is not an integer", v)
		}
	}
	return out, nil
}

func toStrings(vals []any) []string {
	out := make([]string, 0, len(vals))
	for _, v := range vals {
		out = append(out, fmt.Sprint(v))
	}
	return out
}
