package datavolume

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

func TestComputeStatus(t *testing.T) {
	claim := func(phase corev1.PersistentVolumeClaimPhase, ann map[string]string) *corev1.PersistentVolumeClaim {
		return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "d", Annotations: ann}, Status: corev1.PersistentVolumeClaimStatus{Phase: phase}}
	}
	running := map[string]string{importstate.AnnPhase: "Running", importstate.AnnProgress: "42.50%"}
	for name, c := range map[string]struct {
		pvc               *corev1.PersistentVolumeClaim
		kind              string
		waiting           bool
		phase             cdiv1.DataVolumePhase
		progress          string
		bound, run, ready corev1.ConditionStatus
		runReason         string
		restarts          int32
	}{
		"pending":          {claim(corev1.ClaimPending, nil), "http", false, cdiv1.Pending, "N/A", "False", "False", "False", "Pending", 0},
		"wffc":             {claim(corev1.ClaimPending, nil), "http", true, cdiv1.WaitForFirstConsumer, "N/A", "False", "False", "False", "WaitForFirstConsumer", 0},
		"wffc placed":      {claim(corev1.ClaimPending, map[string]string{importstate.AnnSelectedNode: "n"}), "http", true, cdiv1.Pending, "N/A", "False", "False", "False", "Pending", 0},
		"scheduled":        {claim(corev1.ClaimBound, nil), "http", false, cdiv1.ImportScheduled, "N/A", "True", "False", "False", "Pending", 0},
		"clone scheduled":  {claim(corev1.ClaimBound, nil), "pvc", false, cdiv1.CloneScheduled, "N/A", "True", "False", "False", "Pending", 0},
		"importing":        {claim(corev1.ClaimBound, running), "http", false, cdiv1.ImportInProgress, "42.50%", "True", "True", "False", "", 0},
		"cloning":          {claim(corev1.ClaimBound, running), "pvc", false, cdiv1.CloneInProgress, "42.50%", "True", "True", "False", "", 0},
		"upload scheduled": {claim(corev1.ClaimBound, nil), "upload", false, cdiv1.UploadScheduled, "N/A", "True", "False", "False", "Pending", 0},
		"upload ready": {claim(corev1.ClaimBound, map[string]string{importstate.AnnPhase: "Running", importstate.AnnReady: "true"}),
			"upload", false, cdiv1.UploadReady, "N/A", "True", "True", "False", "", 0},
		"retrying": {claim(corev1.ClaimBound, map[string]string{importstate.AnnPhase: "Running", importstate.AnnRestarts: "2",
			importstate.AnnReason: "SourceUnreachable", importstate.AnnMessage: "503"}),
			"http", false, cdiv1.ImportInProgress, "N/A", "True", "False", "False", "SourceUnreachable", 2},
		"succeeded": {claim(corev1.ClaimBound, map[string]string{importstate.AnnPhase: "Succeeded", importstate.AnnRestarts: "1"}),
			"http", false, cdiv1.Succeeded, "100.0%", "True", "False", "True", "Completed", 1},
		"failed": {claim(corev1.ClaimBound, map[string]string{importstate.AnnPhase: "Failed", importstate.AnnReason: "ChecksumMismatch"}),
			"http", false, cdiv1.Failed, "N/A", "True", "False", "False", "ChecksumMismatch", 0},
		"restore scheduled": {claim(corev1.ClaimBound, nil), "snapshot", false, cdiv1.CloneScheduled, "N/A", "True", "False", "False", "Pending", 0},
		"restored": {claim(corev1.ClaimBound, map[string]string{importstate.AnnPhase: "Succeeded", importstate.AnnReason: "Completed"}),
			"snapshot", false, cdiv1.Succeeded, "100.0%", "True", "False", "True", "Completed", 0},
		"no source": {claim(corev1.ClaimBound, nil), "none", false, cdiv1.Succeeded, "100.0%", "True", "False", "True", "Completed", 0},
		"lost":      {claim(corev1.ClaimLost, nil), "http", false, cdiv1.Failed, "N/A", "False", "False", "False", "ClaimLost", 0},
	} {
		st := computeStatus(&cdiv1.DataVolume{}, c.pvc, c.kind, c.waiting)
		got := func(typ cdiv1.DataVolumeConditionType) cdiv1.DataVolumeCondition {
			return findCondition(st.Conditions, typ)
		}
		if st.Phase != c.phase || string(st.Progress) != c.progress || st.RestartCount != c.restarts || st.ClaimName != "d" {
			t.Errorf("%s: phase %s progress %s restarts %d claim %q", name, st.Phase, st.Progress, st.RestartCount, st.ClaimName)
		}
		if got(cdiv1.DataVolumeBound).Status != c.bound || got(cdiv1.DataVolumeRunning).Status != c.run ||
			got(cdiv1.DataVolumeReady).Status != c.ready || got(cdiv1.DataVolumeRunning).Reason != c.runReason {
			t.Errorf("%s: conditions %+v", name, st.Conditions)
		}
	}
}

func TestConditionTransitionTimesAreKept(t *testing.T) {
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "d"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
	first := computeStatus(&cdiv1.DataVolume{}, pvc, "http", false)
	old := metav1.NewTime(metav1.Now().Add(-3600e9))
	for i := range first.Conditions {
		first.Conditions[i].LastTransitionTime = old
	}
	dv := &cdiv1.DataVolume{Status: first}
	again := computeStatus(dv, pvc, "http", false)
	if !again.Conditions[0].LastTransitionTime.Equal(&old) {
		t.Errorf("unchanged condition got a new transition time")
	}
	pvc.Annotations = map[string]string{importstate.AnnPhase: "Succeeded"}
	done := computeStatus(dv, pvc, "http", false)
	if ready := findCondition(done.Conditions, cdiv1.DataVolumeReady); ready.LastTransitionTime.Equal(&old) {
		t.Errorf("changed condition kept its old transition time")
	}
}
