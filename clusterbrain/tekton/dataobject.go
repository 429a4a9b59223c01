package tekton

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
	"sigs.k8s.io/yaml"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
)

// Kinds modify-data-object handles.
const (
	kindDataVolume = "DataVolume"
	kindDataSource = "DataSource"
	kindPVC        = "PersistentVolumeClaim"
)

// importRestartLimit is how many importer restarts, with the import not
// running on an error, make waitForSuccess give up (upstream's threshold).
const importRestartLimit = 3

var dataResources = map[string]schema.GroupVersionResource{
	kindDataVolume: cdiv1.SchemeGroupVersion.WithResource("datavolumes"),
	kindDataSource: cdiv1.SchemeGroupVersion.WithResource("datasources"),
	kindPVC:        corev1.SchemeGroupVersion.WithResource("persistentvolumeclaims"),
}

func modifyDataObject(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	manifest := fs.String("manifest", "", "YAML manifest of the DataVolume or DataSource to create")
	ns := fs.String("namespace", "", "namespace of the object (default: the manifest's, else the active one)")
	waitFor := fs.String("waitForSuccess", "false", "true or false: wait until the DataVolume succeeded or the DataSource is Ready")
	allowReplace := fs.String("allowReplace", "false", "true or false: delete an object of the same name first")
	del := fs.String("deleteObject", "false", "true or false: delete deleteObjectKind deleteObjectName instead (every other parameter is ignored)")
	delKind := fs.String("deleteObjectKind", "", "DataVolume, DataSource or PersistentVolumeClaim: what deleteObject deletes")
	delName := fs.String("deleteObjectName", "", "name of what deleteObject deletes")
	timeout := fs.String("timeout", "1h", "how long waitForSuccess waits, e.g. 3h2m1s")
	owner := ownerFlag(fs)
	return func(ctx context.Context, c *virtctl.Client, r results) error {
		doDelete, err := boolParam("deleteObject", *del)
		if err != nil {
			return err
		}
		dyn, err := dynamic.NewForConfig(c.Config)
		if err != nil {
			return err
		}
		*ns = strings.TrimSpace(*ns)
		if doDelete {
			defaultNS(c, ns)
			return deleteDataObject(ctx, dyn, *ns, strings.TrimSpace(*delKind), strings.TrimSpace(*delName), r)
		}
		wait, err := boolParam("waitForSuccess", *waitFor)
		if err != nil {
			return err
		}
		replace, err := boolParam("allowReplace", *allowReplace)
		if err != nil {
			return err
		}
		limit, err := time.ParseDuration(*timeout)
		if err != nil {
			return fmt.Errorf("timeout: %w", err)
		}
		if strings.TrimSpace(*manifest) == "" {
			return fmt.Errorf("manifest %w", errMissing)
		}
		obj := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(*manifest), &obj.Object); err != nil {
			return fmt.Errorf("manifest: %w", err)
		}
		gvk := obj.GroupVersionKind()
		if gvk.Group != cdiv1.SchemeGroupVersion.Group || (gvk.Kind != kindDataVolume && gvk.Kind != kindDataSource) {
			return fmt.Errorf("manifest is a %s %s: only cdi.kubevirt.io DataVolumes and DataSources are data objects", obj.GetAPIVersion(), obj.GetKind())
		}
		if obj.GetName() == "" && obj.GetGenerateName() == "" {
			return fmt.Errorf("manifest: metadata.name %w", errMissing)
		}
		switch {
		case *ns != "":
			obj.SetNamespace(*ns)
		case obj.GetNamespace() == "":
			obj.SetNamespace(c.Namespace)
		}
		if err := owner.set(ctx, c, obj); err != nil {
			return err
		}
		res := dyn.Resource(gvk.GroupVersion().WithResource(dataResources[gvk.Kind].Resource)).Namespace(obj.GetNamespace())
		if replace && obj.GetName() != "" {
			if err := replaceDataObject(ctx, dyn, res, obj); err != nil {
				return err
			}
		}
		got, err := res.Create(ctx, obj, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create %s %s/%s: %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), err)
		}
		if err := r.set("name", got.GetName()); err != nil {
			return err
		}
		if err := r.set("namespace", got.GetNamespace()); err != nil {
			return err
		}
		if !wait {
			return nil
		}
		wctx, cancel := context.WithTimeout(ctx, limit)
		defer cancel()
		check := dataVolumeDone
		if gvk.Kind == kindDataSource {
			check = dataSourceReady
		}
		if err := poll(wctx, time.Second, func() (bool, error) { return check(wctx, c, got.GetNamespace(), got.GetName()) }); err != nil {
			return fmt.Errorf("%s %s/%s: %w", gvk.Kind, got.GetNamespace(), got.GetName(), err)
		}
		return nil
	}
}

func deleteDataObject(ctx context.Context, dyn dynamic.Interface, ns, kind, name string, r results) error {
	gvr, ok := dataResources[kind]
	if !ok {
		return fmt.Errorf("deleteObjectKind %q: one of %s, %s, %s", kind, kindDataVolume, kindDataSource, kindPVC)
	}
	if name == "" {
		return fmt.Errorf("deleteObjectName %w", errMissing)
	}
	err := dyn.Resource(gvr).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete %s %s/%s: %w", kind, ns, name, err)
	}
	if err := r.set("name", name); err != nil {
		return err
	}
	return r.set("namespace", ns)
}

// replaceDataObject deletes the object of obj's name and waits until it
// is gone; for a DataVolume already collected, its PVC goes instead.
func replaceDataObject(ctx context.Context, dyn dynamic.Interface, res dynamic.ResourceInterface, obj *unstructured.Unstructured) error {
	ns, name := obj.GetNamespace(), obj.GetName()
	if _, err := res.Get(ctx, name, metav1.GetOptions{}); apierrors.IsNotFound(err) && obj.GetKind() == kindDataVolume {
		res = dyn.Resource(dataResources[kindPVC]).Namespace(ns)
	}
	if err := res.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("replace %s/%s: %w", ns, name, err)
	}
	return poll(ctx, 500*time.Millisecond, func() (bool, error) {
		_, err := res.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
}

// dataVolumeDone is upstream's success test: Succeeded and Bound, or the
// DataVolume collected with its PVC left; Failed, or an importer that
// keeps restarting on an error, fails.
func dataVolumeDone(ctx context.Context, c *virtctl.Client, ns, name string) (bool, error) {
	dv, err := c.Virt.DataVolumes.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		if _, err := c.Kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return false, fmt.Errorf("gone, and no claim is left: %w", err)
		}
		return true, nil
	}
	if err != nil {
		return false, err
	}
	cond := map[cdiv1.DataVolumeConditionType]cdiv1.DataVolumeCondition{}
	for _, c := range dv.Status.Conditions {
		cond[c.Type] = c
	}
	switch {
	case dv.Status.Phase == cdiv1.Succeeded && cond[cdiv1.DataVolumeBound].Status == corev1.ConditionTrue:
		return true, nil
	case dv.Status.Phase == cdiv1.Failed:
		return false, fmt.Errorf("failed: %s", cond[cdiv1.DataVolumeRunning].Message)
	case dv.Status.Phase == cdiv1.ImportInProgress && dv.Status.RestartCount > importRestartLimit &&
		cond[cdiv1.DataVolumeRunning].Status == corev1.ConditionFalse && cond[cdiv1.DataVolumeRunning].Reason == "Error":
		return false, fmt.Errorf("import failed %d times: %s", dv.Status.RestartCount, cond[cdiv1.DataVolumeRunning].Message)
	}
	return false, nil
}

func dataSourceReady(ctx context.Context, c *virtctl.Client, ns, name string) (bool, error) {
	ds, err := c.Virt.DataSources.Get(ctx, ns, name)
	if err != nil {
		return false, err
	}
	for _, c := range ds.Status.Conditions {
		if c.Type == cdiv1.DataSourceReady {
			return c.Status == corev1.ConditionTrue, nil
		}
	}
	return false, nil
}

// poll calls done every interval until it says so, fails, or ctx ends.
func poll(ctx context.Context, every time.Duration, done func() (bool, error)) error {
	for {
		ok, err := done()
		if ok || err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(every):
		}
	}
}
