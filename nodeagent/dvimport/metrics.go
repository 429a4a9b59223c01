package dvimport

import (
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/nodeagent/importer"
)

// The role's metrics, served by the node's /metrics: CDI's progress names
// (per DataVolume, or per claim for a bare upload; present while the work
// runs, as CDI's importer pods are), and nodevirt's own throughput and
// duration figures.
var (
	importProgress = metrics.Default().Gauge("kubevirt_cdi_import_progress_total",
		"The import progress in percentage.", "ownerUID")
	cloneProgress = metrics.Default().Gauge("kubevirt_cdi_clone_progress_total",
		"The clone progress in percentage.", "ownerUID")
	uploadProgress = metrics.Default().Gauge("kubevirt_cdi_upload_progress_total",
		"The upload progress in percentage.", "ownerUID")
	sourceBytes = metrics.Default().Counter("nodevirt_import_source_bytes_total",
		"Bytes read from import, clone and upload sources.", "source")
	importDuration = metrics.Default().Histogram("nodevirt_import_duration_seconds",
		"Duration of import, clone and upload attempts.", metrics.LatencyBuckets, "source", "result")
)

// progressGauge is the progress series of t.
func (t *target) progressGauge() metrics.Gauge {
	owner := string(t.pvc.UID)
	if t.dv != nil {
		owner = string(t.dv.UID)
	}
	switch t.kind {
	case importstate.SourcePVC:
		return cloneProgress.With(owner)
	case importstate.SourceUpload:
		return uploadProgress.With(owner)
	}
	return importProgress.With(owner)
}

// observe records a progress report of t.
func (t *target) observe(p importer.Progress) {
	t.progressGauge().Set(p.Percent)
}

// finished records an attempt's end: its duration and the source bytes
// it read, by result ("ok" or the failure reason).
func (t *target) finished(start time.Time, res importer.Result, err error) {
	result := "ok"
	if err != nil {
		result = string(importer.ReasonOf(err))
	} else {
		t.progressGauge().Set(100)
	}
	sourceBytes.With(t.kind).Add(float64(res.SourceBytes))
	importDuration.With(t.kind, result).Observe(time.Since(start).Seconds())
}

// forget drops t's progress series (its work is over or canceled).
func (t *target) forget() {
	owner := string(t.pvc.UID)
	if t.dv != nil {
		owner = string(t.dv.UID)
	}
	importProgress.Delete(owner)
	cloneProgress.Delete(owner)
	uploadProgress.Delete(owner)
}
