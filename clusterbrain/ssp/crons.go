package ssp

import (
	"context"
	"errors"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
)

// GoldenImagesNamespace is where boot sources go when their template names
// no namespace.
const GoldenImagesNamespace = "kubevirt-os-images"

// cronSelector finds the DataImportCrons this role owns.
var cronSelector = templates.LabelManagedBy + "=" + templates.ManagedBy

// syncCrons makes the DataImportCrons match every SSP's
// dataImportCronTemplates (HCO puts its default boot sources there while
// enableCommonBootImageImport is on) and removes the managed ones no SSP
// asks for any more.
func (r *Role) syncCrons(ctx context.Context, ssps []*sspv1beta2.SSP) error {
	want := map[string]*cdiv1.DataImportCron{}
	for _, s := range ssps {
		if s.DeletionTimestamp != nil {
			continue
		}
		for _, t := range s.Spec.CommonTemplates.DataImportCronTemplates {
			if t.Spec == nil || t.Name == "" {
				continue
			}
			ns := t.Namespace
			if ns == "" {
				ns = GoldenImagesNamespace
			}
			labels := map[string]string{templates.LabelManagedBy: templates.ManagedBy}
			for k, v := range t.Labels {
				labels[k] = v
			}
			want[ns+"/"+t.Name] = &cdiv1.DataImportCron{
				ObjectMeta: metav1.ObjectMeta{Name: t.Name, Namespace: ns, Labels: labels, Annotations: t.Annotations},
				Spec:       *t.Spec.DeepCopy(),
			}
		}
	}
	dics := r.cfg.Virt.DataImportCrons
	have, err := dics.List(ctx, "", metav1.ListOptions{LabelSelector: cronSelector})
	if err != nil {
		return fmt.Errorf("list dataimportcrons: %w", err)
	}
	var errs []error
	seen := map[string]bool{}
	for _, cur := range have {
		k := cur.Namespace + "/" + cur.Name
		w, ok := want[k]
		if !ok {
			if err := dics.Delete(ctx, cur.Namespace, cur.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("delete dataimportcron %s: %w", k, err))
			} else {
				r.cfg.Log.Info("removed boot source", "namespace", cur.Namespace, "name", cur.Name)
			}
			continue
		}
		seen[k] = true
		if jsonEqual(cur.Spec, w.Spec) && subset(w.Labels, cur.Labels) && subset(w.Annotations, cur.Annotations) {
			continue
		}
		upd := cur.DeepCopy()
		upd.Spec = w.Spec
		upd.Labels = mergeMaps(upd.Labels, w.Labels)
		upd.Annotations = mergeMaps(upd.Annotations, w.Annotations)
		if _, err := dics.Update(ctx, upd); err != nil {
			errs = append(errs, fmt.Errorf("update dataimportcron %s: %w", k, err))
		}
	}
	for k, w := range want {
		if seen[k] {
			continue
		}
		if err := r.ensureNamespace(ctx, w.Namespace); err != nil {
			errs = append(errs, err)
			continue
		}
		if _, err := dics.Create(ctx, w); err != nil && !apierrors.IsAlreadyExists(err) {
			errs = append(errs, fmt.Errorf("create dataimportcron %s: %w", k, err))
			continue
		}
		r.cfg.Log.Info("created boot source", "namespace", w.Namespace, "name", w.Name, "dataSource", w.Spec.ManagedDataSource)
	}
	return errors.Join(errs...)
}

func subset(want, have map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}

func mergeMaps(into, from map[string]string) map[string]string {
	if into == nil {
		into = map[string]string{}
	}
	for k, v := range from {
		into[k] = v
	}
	return into
}
