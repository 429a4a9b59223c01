package hco

import (
	"encoding/json"
	"fmt"
	"reflect"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/apis/hco/v1beta1"
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
func applyPatchAnnotation(hc *hcov1beta1.HyperConverged, name string, obj any) error {
	raw, ok := hc.Annotations[name]
	if !ok {
		return nil
	}
	if err := applyPatch(obj, raw); err != nil {
		return fmt.Errorf("invalid jsonPatch in the %s annotation: %w", name, err)
	}
	return nil
}

func applyPatch(obj any, raw string) error {
	patch, err := jsonpatch.DecodePatch([]byte(raw))
	if err != nil {
		return err
	}
	doc, err := json.Marshal(obj)
	if err != nil {
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
