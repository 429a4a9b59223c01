package dataimportcron

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

// SyncDataSource keeps a DataSource's status: its resolved source and
// Ready, true when the PVC it names holds a finished import (the
// DataVolume of that name Succeeded).
func (c *Controller) SyncDataSource(ctx context.Context, ns, name string) error {
	v := c.cfg.Virt
	ds, err := v.DataSources.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("get datasource: %w", err)
	}
	status, reason, msg := corev1.ConditionFalse, "NoSource", "no source PVC"
	if p := ds.Spec.Source.PVC; p != nil {
		pns := p.Namespace
		if pns == "" {
			pns = ns
		}
		status, reason, msg, err = c.pvcReady(ctx, pns, p.Name)
		if err != nil {
			return err
		}
	} else if ds.Spec.Source.Snapshot != nil || ds.Spec.Source.DataSource != nil {
		status, reason, msg = corev1.ConditionUnknown, "NotSupported", "only pvc sources are checked"
	}
	st := ds.Status.DeepCopy()
	st.Source = ds.Spec.Source
	var c0 *cdiv1.DataSourceCondition
	for i := range st.Conditions {
		if st.Conditions[i].Type == cdiv1.DataSourceReady {
			c0 = &st.Conditions[i]
		}
	}
	if c0 == nil {
		st.Conditions = append(st.Conditions, cdiv1.DataSourceCondition{Type: cdiv1.DataSourceReady})
		c0 = &st.Conditions[len(st.Conditions)-1]
	}
	if c0.Status != status {
		c0.LastTransitionTime = metav1.NewTime(c.cfg.Now())
	}
	c0.Status, c0.Reason, c0.Message = status, reason, msg
	if equalJSON(ds.Status, *st) {
		return nil
	}
	upd := ds.DeepCopyObject().(*cdiv1.DataSource)
	upd.Status = *st
	if _, err := v.DataSources.UpdateStatus(ctx, upd); err != nil {
		return fmt.Errorf("update datasource status: %w", err)
	}
	return nil
}

func (c *Controller) pvcReady(ctx context.Context, ns, name string) (corev1.ConditionStatus, string, string, error) {
	dv, err := c.cfg.Virt.DataVolumes.Get(ctx, ns, name)
	switch {
	case err == nil && dv.Status.Phase == cdiv1.Succeeded:
		return corev1.ConditionTrue, "Ready", "", nil
	case err == nil:
		return corev1.ConditionFalse, string(dv.Status.Phase), fmt.Sprintf("DataVolume %s/%s is %s", ns, name, phaseOr(dv.Status.Phase)), nil
	case !apierrors.IsNotFound(err):
		return "", "", "", fmt.Errorf("get datavolume %s/%s: %w", ns, name, err)
	}
	return corev1.ConditionFalse, "NotFound", fmt.Sprintf("DataVolume %s/%s not found", ns, name), nil
}

func phaseOr(p cdiv1.DataVolumePhase) string {
	if p == "" {
		return "pending"
	}
	return string(p)
}

func equalJSON(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}
