package crds

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
)

// FieldManager owns the fields nodevirt applies.
const FieldManager = "nodevirt-clusterbrain"

// Install applies every CRD of kinds (server-side apply, so upgrades replace
// what an older nodevirt wrote and leave others' fields alone) and waits
// until all are Established.
func Install(ctx context.Context, client apiextensionsclient.Interface, kinds []Kind) error {
	crds := client.ApiextensionsV1().CustomResourceDefinitions()
	for _, k := range kinds {
		def := k.Definition()
		data, err := json.Marshal(def)
		if err != nil {
			return fmt.Errorf("encode crd %s: %w", def.Name, err)
		}
		force := true
		if _, err := crds.Patch(ctx, def.Name, types.ApplyPatchType, data,
			metav1.PatchOptions{FieldManager: FieldManager, Force: &force}); err != nil {
			return fmt.Errorf("apply crd %s: %w", def.Name, err)
		}
	}
	for _, k := range kinds {
		name := k.Plural + "." + k.Group
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			crd, err := crds.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, nil
			}
			for _, c := range crd.Status.Conditions {
				if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("crd %s not established: %w", name, err)
		}
	}
	return nil
}
