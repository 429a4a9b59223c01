package tekton

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/dataimportcron"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestModifyDataObject(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	// The brain's DataSource controller keeps the DataSources' Ready.
	dic, err := dataimportcron.New(dataimportcron.Config{Virt: e.c.Virt, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = dic.Run(cctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	dv := `apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata:
  name: golden
spec:
  source:
    blank: {}
  storage:
    resources:
      requests:
        storage: 64Mi
`
	e.run(t, 0, "modify-data-object", "--manifest="+dv)
	if e.result(t, "name") != "golden" || e.result(t, "namespace") != e.ns {
		t.Errorf("results %q %q", e.result(t, "name"), e.result(t, "namespace"))
	}
	if out := e.run(t, 1, "modify-data-object", "--manifest="+dv); !strings.Contains(out, "already exists") {
		t.Errorf("a second create without allowReplace: %s", out)
	}

	// allowReplace with waitForSuccess: the old one goes, the new one is
	// waited for until the import (here: its status) succeeds.
	old, _ := e.c.Virt.DataVolumes.Get(ctx, e.ns, "golden")
	finish := func(phase cdiv1.DataVolumePhase) {
		time.Sleep(time.Second)
		// A goroutine of the test: it reports, the test goes on.
		if err := testkit.Wait(200*time.Millisecond, 60*time.Second, "the replacement's phase "+string(phase), func() (bool, error) {
			cur, err := e.c.Virt.DataVolumes.Get(ctx, e.ns, "golden")
			if err != nil || cur.UID == old.UID { // not yet the replacement
				return false, err
			}
			cur.Status.Phase = phase
			cur.Status.Conditions = []cdiv1.DataVolumeCondition{{Type: cdiv1.DataVolumeBound, Status: corev1.ConditionTrue},
				{Type: cdiv1.DataVolumeRunning, Status: corev1.ConditionFalse, Message: "import " + string(phase)}}
			_, err = e.c.Virt.DataVolumes.UpdateStatus(ctx, cur)
			return err == nil, err
		}); err != nil {
			t.Error(err)
		}
	}
	go finish(cdiv1.Succeeded)
	t0 := time.Now()
	e.run(t, 0, "modify-data-object", "--manifest="+dv, "--allowReplace=true", "--waitForSuccess=true", "--timeout=2m")
	if time.Since(t0) < 900*time.Millisecond {
		t.Error("waitForSuccess returned before the import succeeded")
	}
	old, _ = e.c.Virt.DataVolumes.Get(ctx, e.ns, "golden")
	go finish(cdiv1.Failed)
	if out := e.run(t, 1, "modify-data-object", "--manifest="+dv, "--allowReplace=true", "--waitForSuccess=true", "--timeout=2m"); !strings.Contains(out, "failed") {
		t.Errorf("a failed import: %s", out)
	}
	old, _ = e.c.Virt.DataVolumes.Get(ctx, e.ns, "golden")
	go finish(cdiv1.Succeeded)
	e.run(t, 0, "modify-data-object", "--manifest="+dv, "--allowReplace=true", "--waitForSuccess=true", "--timeout=2m")

	// A DataSource on it turns Ready through the brain's controller.
	ds := `apiVersion: cdi.kubevirt.io/v1beta1
kind: DataSource
metadata:
  name: golden-ds
spec:
  source:
    pvc:
      name: golden
`
	e.run(t, 0, "modify-data-object", "--manifest="+ds, "--waitForSuccess=true", "--timeout=2m")
	got, err := e.c.Virt.DataSources.Get(ctx, e.ns, "golden-ds")
	if err != nil || len(got.Status.Conditions) == 0 || got.Status.Conditions[0].Status != corev1.ConditionTrue {
		t.Errorf("DataSource after waitForSuccess: %v %+v", err, got)
	}
	// One on nothing times out.
	if out := e.run(t, 1, "modify-data-object", "--manifest="+strings.ReplaceAll(strings.ReplaceAll(ds, "golden-ds", "none-ds"), "name: golden", "name: absent"),
		"--waitForSuccess=true", "--timeout=3s"); !strings.Contains(out, "deadline") {
		t.Errorf("waiting for a DataSource that cannot be ready: %s", out)
	}

	for _, bad := range []string{"kind: Pod\napiVersion: v1\nmetadata: {name: p}\n", "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\n", "{"} {
		e.run(t, 1, "modify-data-object", "--manifest="+bad)
	}
	e.run(t, 1, "modify-data-object", "--deleteObject=true", "--deleteObjectKind=Pod", "--deleteObjectName=x")

	e.run(t, 0, "modify-data-object", "--deleteObject=true", "--deleteObjectKind=DataSource", "--deleteObjectName=golden-ds")
	e.run(t, 0, "modify-data-object", "--deleteObject=true", "--deleteObjectKind=DataVolume", "--deleteObjectName=golden")
	if _, err := e.c.Virt.DataSources.Get(ctx, e.ns, "golden-ds"); !apierrors.IsNotFound(err) {
		t.Errorf("DataSource not deleted: %v", err)
	}
	if _, err := e.c.Virt.DataVolumes.Get(ctx, e.ns, "golden"); !apierrors.IsNotFound(err) {
		t.Errorf("DataVolume not deleted: %v", err)
	}
	e.run(t, 0, "modify-data-object", "--deleteObject=true", "--deleteObjectKind=DataVolume", "--deleteObjectName=golden")
}
