package datavolume

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
)

// retryAfter is how soon a DataVolume waiting on something the controller
// does not watch (a DataSource, a clone source, a node) is looked at again.
const retryAfter = 5 * time.Second

// sync reconciles one DataVolume. It returns a delay when the DataVolume
// should be looked at again without any watched change.
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	dv, err := c.dataVolume(key)
	if err != nil || dv == nil || dv.DeletionTimestamp != nil {
		// The PVC is owned by the DataVolume: the garbage collector removes
		// it, and the node cancels the import when the DataVolume goes.
		return 0, err
	}
	log := c.log.With("namespace", dv.Namespace, "datavolume", dv.Name)
	src, err := c.resolveSource(ctx, dv)
	if err != nil {
		return c.pending(ctx, dv, err)
	}
	if src != nil && src.PVC != nil && src.PVC.Namespace == "" {
		src = src.DeepCopy()
		src.PVC.Namespace = dv.Namespace
	}
	if kind := sourceKind(src); !supportedKinds[kind] {
		st := failedStatus(dv, "UnsupportedSource", fmt.Sprintf("source %s is not supported by nodevirt", kind))
		return 0, c.writeStatus(ctx, dv, st)
	}
	if src != nil && src.Snapshot != nil && src.Snapshot.Namespace == "" {
		src = src.DeepCopy()
		src.Snapshot.Namespace = dv.Namespace
	}
	if err := checkAuthorized(dv, src); err != nil {
		return c.pending(ctx, dv, err)
	}
	pvc, err := c.pvcs.PersistentVolumeClaims(dv.Namespace).Get(dv.Name)
	if apierrors.IsNotFound(err) && dv.Annotations[migstate.AnnClaimMoving] != "" {
		// A live migration replaces the claim by one bound to the copy of
		// its volume on another node (package migstate).
		log.Info("claim moving with a migration", "migration", dv.Annotations[migstate.AnnClaimMoving])
		return retryAfter, nil
	}
	if apierrors.IsNotFound(err) {
		want, err := c.buildClaim(ctx, dv, src)
		if err != nil {
			return c.pending(ctx, dv, err)
		}
		pvc, err = c.kube.CoreV1().PersistentVolumeClaims(dv.Namespace).Create(ctx, want, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return 0, nil // the informer brings it
		}
		if err != nil {
			return 0, fmt.Errorf("create pvc: %w", err)
		}
		log.Info("created pvc", "storageClass", deref(pvc.Spec.StorageClassName), "size", pvc.Spec.Resources.Requests.Storage().String())
	} else if err != nil {
		return 0, err
	}
	if !metav1.IsControlledBy(pvc, dv) {
		return c.pending(ctx, dv, &claimError{reason: "ErrResourceExists", err: errNotOwned})
	}

	sc := c.storageClass(deref(pvc.Spec.StorageClassName))
	wffc := sc != nil && sc.VolumeBindingMode != nil && *sc.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer
	kind := sourceKind(src)
	immediate := dv.Annotations[importstate.AnnImmediateBinding] == "true" || kind == importstate.SourceUpload
	if wffc && !immediate && pvc.Status.Phase == corev1.ClaimPending {
		immediate = !c.honorsWaitForFirstConsumer(ctx)
	}
	var after time.Duration
	var unplaced *claimError
	if pvc.Status.Phase == corev1.ClaimPending && pvc.Annotations[importstate.AnnSelectedNode] == "" &&
		((wffc && immediate) || placesImmediateClass(sc)) {
		if err := c.placeImmediately(ctx, pvc, src, c.workloadPlacement); err != nil {
			if !errors.As(err, &unplaced) {
				return 0, err
			}
			log.Info("cannot place claim yet", "reason", unplaced.reason, "err", err)
			after = retryAfter
		}
	}
	st := computeStatus(dv, pvc, kind, wffc && !immediate)
	if unplaced != nil {
		// Pending, saying why no node takes the volume; a warning event
		// when the reason is new.
		if old := findCondition(dv.Status.Conditions, cdiv1.DataVolumeBound); old.Message != unplaced.Error() {
			c.recorder.Event(dv, corev1.EventTypeWarning, unplaced.reason, unplaced.Error())
		}
		st.Conditions = nil
		setConditions(&st, dv.Status.Conditions,
			cond(cdiv1.DataVolumeBound, false, unplaced.reason, unplaced.Error()),
			cond(cdiv1.DataVolumeRunning, false, unplaced.reason, ""),
			cond(cdiv1.DataVolumeReady, false, unplaced.reason, ""))
	}
	if err := c.writeStatus(ctx, dv, st); err != nil {
		return 0, err
	}
	if req, ok := cloneRequestOf(pvc, src); ok {
		if st.Phase == cdiv1.Succeeded || st.Phase == cdiv1.Failed {
			return after, c.deleteCloneRequest(ctx, pvc)
		}
		return after, c.ensureCloneRequest(ctx, pvc, req)
	}
	return after, nil
}

// placesImmediateClass reports whether the brain picks the node of claims
// of sc, an Immediate class: it does for the hostpath provisioners (CSI
// and legacy), whose volumes live on one node, as the CSI
// external-provisioner picks a topology for Immediate claims.
func placesImmediateClass(sc *storagev1.StorageClass) bool {
	if sc == nil || (sc.VolumeBindingMode != nil && *sc.VolumeBindingMode != storagev1.VolumeBindingImmediate) {
		return false
	}
	return sc.Provisioner == HostpathProvisioner || sc.Provisioner == LegacyHostpathProvisioner
}

// pending records why the PVC cannot be made yet and retries later.
func (c *Controller) pending(ctx context.Context, dv *cdiv1.DataVolume, cause error) (time.Duration, error) {
	var ce *claimError
	if !errors.As(cause, &ce) {
		return 0, cause
	}
	if ce.fatal {
		return 0, c.writeStatus(ctx, dv, failedStatus(dv, ce.reason, ce.Error()))
	}
	st := cdiv1.DataVolumeStatus{ClaimName: dv.Name, Phase: cdiv1.Pending, Progress: "N/A", RestartCount: dv.Status.RestartCount}
	setConditions(&st, dv.Status.Conditions,
		cond(cdiv1.DataVolumeBound, false, ce.reason, ce.Error()),
		cond(cdiv1.DataVolumeRunning, false, ce.reason, ""),
		cond(cdiv1.DataVolumeReady, false, ce.reason, ""))
	return retryAfter, c.writeStatus(ctx, dv, st)
}

func failedStatus(dv *cdiv1.DataVolume, reason, msg string) cdiv1.DataVolumeStatus {
	st := cdiv1.DataVolumeStatus{ClaimName: dv.Name, Phase: cdiv1.Failed, Progress: "N/A", RestartCount: dv.Status.RestartCount}
	setConditions(&st, dv.Status.Conditions,
		cond(cdiv1.DataVolumeBound, false, reason, msg),
		cond(cdiv1.DataVolumeRunning, false, reason, msg),
		cond(cdiv1.DataVolumeReady, false, reason, msg))
	return st
}

// writeStatus stores st when it differs and emits the events of the change.
func (c *Controller) writeStatus(ctx context.Context, dv *cdiv1.DataVolume, st cdiv1.DataVolumeStatus) error {
	if apiequality.Semantic.DeepEqual(withoutHeartbeats(dv.Status), withoutHeartbeats(st)) {
		return nil
	}
	now := metav1.Now()
	for i := range st.Conditions {
		st.Conditions[i].LastHeartbeatTime = now
	}
	upd := dv.DeepCopy()
	upd.Status = st
	if _, err := c.virt.DataVolumes.UpdateStatus(ctx, upd); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		// A conflict means the cache is behind: try again.
		return fmt.Errorf("update datavolume status: %w", err)
	}
	c.emitEvents(upd, dv.Status, st)
	return nil
}

func (c *Controller) emitEvents(dv *cdiv1.DataVolume, old, cur cdiv1.DataVolumeStatus) {
	if c.recorder == nil {
		return
	}
	if cur.RestartCount > old.RestartCount {
		running := findCondition(cur.Conditions, cdiv1.DataVolumeRunning)
		c.recorder.Eventf(dv, corev1.EventTypeWarning, "ErrImportFailed", "attempt %d failed: %s", cur.RestartCount, running.Message)
	}
	if cur.Phase == old.Phase {
		return
	}
	reason, msg := string(cur.Phase), ""
	typ := corev1.EventTypeNormal
	switch cur.Phase {
	case cdiv1.Succeeded:
		reason, msg = "ImportSucceeded", fmt.Sprintf("Successfully imported into PVC %s", dv.Name)
		if dv.Spec.Source != nil && dv.Spec.Source.Upload != nil {
			reason, msg = "UploadSucceeded", fmt.Sprintf("Successfully uploaded into PVC %s", dv.Name)
		}
		if dv.Spec.Source != nil && dv.Spec.Source.Snapshot != nil {
			reason, msg = "CloneSucceeded", fmt.Sprintf("Successfully restored snapshot %s into PVC %s", dv.Spec.Source.Snapshot.Name, dv.Name)
		}
	case cdiv1.Failed:
		typ = corev1.EventTypeWarning
		running := findCondition(cur.Conditions, cdiv1.DataVolumeRunning)
		reason, msg = "Error"+running.Reason, running.Message
		if running.Reason == "" {
			reason = "Error"
		}
	case cdiv1.PVCBound, cdiv1.ImportScheduled, cdiv1.UploadScheduled, cdiv1.CloneScheduled:
		msg = fmt.Sprintf("PVC %s Bound", dv.Name)
	case cdiv1.UploadReady:
		msg = fmt.Sprintf("Upload into PVC %s is ready", dv.Name)
	case cdiv1.WaitForFirstConsumer:
		msg = fmt.Sprintf("PVC %s waits for its first consumer", dv.Name)
	default:
		msg = fmt.Sprintf("DataVolume phase %s", cur.Phase)
	}
	c.recorder.Event(dv, typ, reason, msg)
}

func withoutHeartbeats(st cdiv1.DataVolumeStatus) cdiv1.DataVolumeStatus {
	st = *st.DeepCopy()
	for i := range st.Conditions {
		st.Conditions[i].LastHeartbeatTime = metav1.Time{}
	}
	return st
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// computeStatus turns the PVC and the node's report into the DataVolume's
// status. waiting says the claim waits for its consumer.
func computeStatus(dv *cdiv1.DataVolume, pvc *corev1.PersistentVolumeClaim, kind string, waiting bool) cdiv1.DataVolumeStatus {
	rep := importstate.Read(pvc)
	st := cdiv1.DataVolumeStatus{ClaimName: pvc.Name, Progress: "N/A", RestartCount: rep.Restarts}
	bound := cond(cdiv1.DataVolumeBound, false, "Pending", fmt.Sprintf("PVC %s Pending", pvc.Name))
	running := cond(cdiv1.DataVolumeRunning, false, "", "")
	ready := cond(cdiv1.DataVolumeReady, false, "", "")

	switch pvc.Status.Phase {
	case corev1.ClaimLost:
		st.Phase = cdiv1.Failed
		bound = cond(cdiv1.DataVolumeBound, false, "ClaimLost", fmt.Sprintf("PVC %s lost its volume", pvc.Name))
		running.Reason, ready.Reason = "ClaimLost", "ClaimLost"
	case corev1.ClaimBound:
		bound = cond(cdiv1.DataVolumeBound, true, "Bound", fmt.Sprintf("PVC %s Bound", pvc.Name))
		st.Phase = boundPhase(kind, rep)
		switch st.Phase {
		case cdiv1.Succeeded:
			st.Progress = "100.0%"
			running.Reason = "Completed"
			ready = cond(cdiv1.DataVolumeReady, true, "", "")
		case cdiv1.Failed:
			running.Reason, running.Message = nonEmpty(rep.Reason, "Error"), rep.Message
			ready.Reason = running.Reason
		case cdiv1.ImportInProgress, cdiv1.CloneInProgress, cdiv1.UploadReady:
			st.Progress = cdiv1.DataVolumeProgress(nonEmpty(rep.Progress, "N/A"))
			if kind == importstate.SourceUpload {
				st.Progress = "N/A"
			}
			if rep.Reason != "" && rep.Reason != "Completed" {
				// Between a failed attempt and the next one.
				running.Reason, running.Message = rep.Reason, rep.Message
			} else {
				running = cond(cdiv1.DataVolumeRunning, true, "", "")
			}
			ready.Reason = "TransferRunning"
		default:
			running.Reason = "Pending"
		}
	default:
		st.Phase = cdiv1.Pending
		if waiting && pvc.Annotations[importstate.AnnSelectedNode] == "" {
			st.Phase = cdiv1.WaitForFirstConsumer
			bound.Reason = "WaitForFirstConsumer"
			bound.Message = fmt.Sprintf("PVC %s waits for its first consumer", pvc.Name)
		}
		running.Reason = bound.Reason
	}
	setConditions(&st, dv.Status.Conditions, bound, running, ready)
	return st
}

// boundPhase is the phase of a DataVolume whose PVC is bound.
func boundPhase(kind string, rep importstate.Report) cdiv1.DataVolumePhase {
	if kind == importstate.SourceNone {
		return cdiv1.Succeeded
	}
	switch rep.Phase {
	case corev1.PodSucceeded:
		return cdiv1.Succeeded
	case corev1.PodFailed:
		return cdiv1.Failed
	case corev1.PodRunning:
		switch {
		case kind == importstate.SourceUpload && rep.Ready:
			return cdiv1.UploadReady
		case kind == importstate.SourceUpload:
			return cdiv1.UploadScheduled
		case kind == importstate.SourcePVC, kind == importstate.SourceSnapshot:
			return cdiv1.CloneInProgress
		}
		return cdiv1.ImportInProgress
	}
	switch kind {
	case importstate.SourceUpload:
		return cdiv1.UploadScheduled
	case importstate.SourcePVC, importstate.SourceSnapshot:
		return cdiv1.CloneScheduled
	}
	return cdiv1.ImportScheduled
}

func nonEmpty(s, fallback string) string {
	if s == "" {
		return fallback
	}
	return s
}

func cond(t cdiv1.DataVolumeConditionType, ok bool, reason, msg string) cdiv1.DataVolumeCondition {
	s := corev1.ConditionFalse
	if ok {
		s = corev1.ConditionTrue
	}
	return cdiv1.DataVolumeCondition{Type: t, Status: s, Reason: reason, Message: msg}
}

// setConditions puts conds into st, keeping the transition times of those
// whose status did not change and the previous heartbeat.
func setConditions(st *cdiv1.DataVolumeStatus, prev []cdiv1.DataVolumeCondition, conds ...cdiv1.DataVolumeCondition) {
	now := metav1.Now()
	for _, c := range conds {
		old := findCondition(prev, c.Type)
		c.LastTransitionTime = now
		if old.Type == c.Type && old.Status == c.Status {
			c.LastTransitionTime = old.LastTransitionTime
		}
		c.LastHeartbeatTime = old.LastHeartbeatTime
		st.Conditions = append(st.Conditions, c)
	}
}

func findCondition(conds []cdiv1.DataVolumeCondition, t cdiv1.DataVolumeConditionType) cdiv1.DataVolumeCondition {
	for _, c := range conds {
		if c.Type == t {
			return c
		}
	}
	return cdiv1.DataVolumeCondition{}
}

// honorsWaitForFirstConsumer is CDI's HonorWaitForFirstConsumer gate: on
// unless a CDI CR exists whose configuration leaves it out, in which case
// claims on WaitForFirstConsumer classes are placed at once, as CDI does
// without the gate.
func (c *Controller) honorsWaitForFirstConsumer(ctx context.Context) bool {
	cdis, err := c.virt.CDIs.List(ctx, "", metav1.ListOptions{})
	if err != nil || len(cdis) == 0 {
		return true
	}
	return featuregate.CDIEnabled(cdis[0].Spec.Config, featuregate.HonorWaitForFirstConsumer)
}
