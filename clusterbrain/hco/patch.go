package hco

import (
	"encoding/json"
	"fmt"
	"reflect"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// JSONPatchAnnotations are the annotations whose presence (with at least one
// operation) raises the TaintedConfiguration condition, as upstream.
var JSONPatchAnnotations = []string{
	hcov1beta1.JSONPatchKubeVirtAnnotation,
	hcov1beta1.JSONPatchCDIAnnotation,
	hcov1beta1.JSONPatchCNAOAnnotation,
	hcov1beta1.JSONPatchSSPAnnotation,
}

// applyPatchAnnotation applies the JSON patch held in the HCO's annotation
// name (if any) to obj, in place.
func applyPatchAnnotation(hc *hcov1beta1.HyperConverged, name string, obj any, lists ...[]string) error {
	raw, ok := hc.Annotations[name]
	if !ok {
		return nil
	}
	if err := applyPatch(obj, raw, lists...); err != nil {
		return fmt.Errorf("invalid jsonPatch in the %s annotation: %w", name, err)
	}
	return nil
}

// applyPatch applies the JSON patch raw to obj. lists are paths (as keys
// from the document's root) of lists that exist, empty, in the document
// the patch sees when obj leaves them out: upstream always renders them
// non-empty, so administrators' patches append to them with "/-".
func applyPatch(obj any, raw string, lists ...[]string) error {
	patch, err := jsonpatch.DecodePatch([]byte(raw))
	if err != nil {
		return err
	}
	doc, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	if doc, err = withLists(doc, lists); err != nil {
		return err
	}
	patched, err := patch.Apply(doc)
	if err != nil {
		return err
	}
	// Unmarshal into a zeroed value so removed fields go away.
	return replaceJSON(obj, patched)
}

// patchOperations counts the operations of a JSON patch; an invalid patch
// counts none (as upstream).
func patchOperations(raw string) int {
	patch, err := jsonpatch.DecodePatch([]byte(raw))
	if err != nil {
		return 0
	}
	return len(patch)
}

// TaintedBy lists the JSON-patch annotations of hc that carry operations.
func TaintedBy(hc *hcov1beta1.HyperConverged) []string {
	var out []string
	for _, a := range JSONPatchAnnotations {
		if raw, ok := hc.Annotations[a]; ok && patchOperations(raw) > 0 {
			out = append(out, a)
		}
	}
	return out
}

// replaceJSON zeroes the value obj points to and decodes data into it.
func replaceJSON(obj any, data []byte) error {
	v := reflect.ValueOf(obj).Elem()
	v.Set(reflect.Zero(v.Type()))
	return json.Unmarshal(data, obj)
}

// withLists adds an empty list at each of paths of the JSON object doc
// where there is nothing, making the objects on the way.
func withLists(doc []byte, paths [][]string) ([]byte, error) {
	if len(paths) == 0 {
		return doc, nil
	}
	var m map[string]any
	if err := json.Unmarshal(doc, &m); err != nil {
		return nil, err
	}
	for _, p := range paths {
		cur := m
		for _, k := range p[:len(p)-1] {
			next, ok := cur[k].(map[string]any)
			if !ok {
				next = map[string]any{}
				cur[k] = next
			}
			cur = next
		}
		if _, ok := cur[p[len(p)-1]]; !ok {
			cur[p[len(p)-1]] = []any{}
		}
	}
	return json.Marshal(m)
}
