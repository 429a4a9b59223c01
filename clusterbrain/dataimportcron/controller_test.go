package dataimportcron

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry/registrytest"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// TestCronImportsEachNewDigest polls a real OCI registry on a (test) clock:
// the first digest is imported and the DataSource points at it once the
// import succeeds; a new image pushed to the tag is imported on the next
// run, the DataSource moves and the old import is collected; an
// unreachable registry shows on UpToDate. The DataVolumes' imports
// themselves are the datavolume role's and the node agents' (the test
// marks them Succeeded in their place).
func TestCronImportsEachNewDigest(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	testkit.InstallCRDs(t, cp)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	reg := registrytest.New()
	host, stop := reg.Serve()
	defer stop()
	// The CDI CR lets imports reach the loopback registry over plain HTTP.
	cdi := &cdiv1.CDI{ObjectMeta: metav1.ObjectMeta{Name: "cdi-dic-test", Annotations: map[string]string{importstate.AnnImportAllowedNetworks: "127.0.0.0/8"}},
		Spec: cdiv1.CDISpec{Config: &cdiv1.CDIConfigSpec{InsecureRegistries: []string{host}}}}
	if _, err := virt.CDIs.Create(ctx, cdi); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = virt.CDIs.Delete(context.Background(), "", cdi.Name, metav1.DeleteOptions{}) })

	d1, _, err := reg.Publish("os/fedora", "latest", map[string][]byte{"disk/disk.img": []byte("first image")})
	if err != nil {
		t.Fatal(err)
	}
	clk := &clock{t: time.Date(2026, 11, 25, 10, 0, 30, 0, time.UTC)}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("DIC_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	ctrl, err := New(Config{Virt: virt, Log: log, Now: clk.now})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = ctrl.Run(runCtx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	url := "docker://" + host + "/os/fedora:latest"
	one := int32(1)
	cron := &cdiv1.DataImportCron{ObjectMeta: metav1.ObjectMeta{Name: "fedora-image-cron", Namespace: ns},
		Spec: cdiv1.DataImportCronSpec{Schedule: "0 */12 * * *", ManagedDataSource: "fedora", ImportsToKeep: &one,
			Template: cdiv1.DataVolume{Spec: cdiv1.DataVolumeSpec{
				Source: &cdiv1.DataVolumeSource{Registry: &cdiv1.DataVolumeSourceRegistry{URL: &url}},
				Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceStorage: resource.MustParse("1Gi")}}}}}}}
	if _, err := virt.DataImportCrons.Create(ctx, cron); err != nil {
		t.Fatal(err)
	}

	succeed := func(name string) {
		t.Helper()
		testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "import "+name+" marked Succeeded", func() error {
			dv, err := virt.DataVolumes.Get(ctx, ns, name)
			if err != nil {
				return err
			}
			dv.Status.Phase = cdiv1.Succeeded
			_, err = virt.DataVolumes.UpdateStatus(ctx, dv)
			return err
		})
	}
	importedAs := func(digest string) string {
		t.Helper()
		name := DataVolumeName("fedora", digest)
		testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the import of "+digest, func() error {
			dv, err := virt.DataVolumes.Get(ctx, ns, name)
			if err != nil {
				return err
			}
			if got := *dv.Spec.Source.Registry.URL; got != "docker://"+host+"/os/fedora@"+digest {
				return fmt.Errorf("import url %s", got)
			}
			if dv.Labels[LabelCron] != "fedora-image-cron" {
				return fmt.Errorf("labels %v", dv.Labels)
			}
			return nil
		})
		return name
	}
	pointsAt := func(dvName, digest string) {
		t.Helper()
		testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the DataSource pointing at "+dvName, func() error {
			ds, err := virt.DataSources.Get(ctx, ns, "fedora")
			if err != nil {
				return err
			}
			if ds.Spec.Source.PVC == nil || ds.Spec.Source.PVC.Name != dvName {
				return fmt.Errorf("datasource source %+v", ds.Spec.Source)
			}
			if len(ds.Status.Conditions) == 0 || ds.Status.Conditions[0].Status != corev1.ConditionTrue {
				return fmt.Errorf("datasource conditions %+v", ds.Status.Conditions)
			}
			c, err := virt.DataImportCrons.Get(ctx, ns, "fedora-image-cron")
			if err != nil {
				return err
			}
			if c.Status.LastImportedPVC == nil || c.Status.LastImportedPVC.Name != dvName ||
				len(c.Status.CurrentImports) != 1 || c.Status.CurrentImports[0].Digest != digest {
				return fmt.Errorf("cron status %+v", c.Status)
			}
			if u := cond(&c.Status, cdiv1.DataImportCronUpToDate); u == nil || u.Status != corev1.ConditionTrue {
				return fmt.Errorf("UpToDate %+v", u)
			}
			return nil
		})
	}

	first := importedAs(d1)
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the empty DataSource not Ready", func() error {
		ds, err := virt.DataSources.Get(ctx, ns, "fedora")
		if err != nil {
			return err
		}
		if len(ds.Status.Conditions) == 0 || ds.Status.Conditions[0].Status != corev1.ConditionFalse {
			return fmt.Errorf("an empty DataSource is Ready: %+v", ds.Status)
		}
		return nil
	})
	succeed(first)
	pointsAt(first, d1)

	// Nothing new before the next scheduled run.
	d2, _, err := reg.Publish("os/fedora", "latest", map[string][]byte{"disk/disk.img": []byte("second image")})
	if err != nil {
		t.Fatal(err)
	}
	touch := func() {
		patch := []byte(fmt.Sprintf(`{"metadata":{"annotations":{"test/touch":"%d"}}}`, time.Now().UnixNano()))
		if _, err := virt.DataImportCrons.Patch(ctx, ns, "fedora-image-cron", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	touch()
	time.Sleep(time.Second)
	if _, err := virt.DataVolumes.Get(ctx, ns, DataVolumeName("fedora", d2)); !apierrors.IsNotFound(err) {
		t.Fatalf("imported before the schedule said: %v", err)
	}

	clk.add(12 * time.Hour) // past 12:00
	touch()
	second := importedAs(d2)
	succeed(second)
	pointsAt(second, d2)
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "the old import "+first+" collected", func() error {
		if _, err := virt.DataVolumes.Get(ctx, ns, first); !apierrors.IsNotFound(err) {
			return fmt.Errorf("old import %s not collected: %v", first, err)
		}
		return nil
	})

	// The registry goes away: a clean condition, the DataSource stays.
	stop()
	clk.add(12 * time.Hour)
	touch()
	testkit.EventuallyEvery(t, 100*time.Millisecond, 30*time.Second, "UpToDate reporting the unreachable registry", func() error {
		c, err := virt.DataImportCrons.Get(ctx, ns, "fedora-image-cron")
		if err != nil {
			return err
		}
		u := cond(&c.Status, cdiv1.DataImportCronUpToDate)
		if u == nil || u.Status != corev1.ConditionFalse || u.Reason != reasonPollFailed || !strings.Contains(u.Message, host) {
			return fmt.Errorf("UpToDate %+v", u)
		}
		return nil
	})
	pointsAtStill, err := virt.DataSources.Get(ctx, ns, "fedora")
	if err != nil || pointsAtStill.Spec.Source.PVC == nil || pointsAtStill.Spec.Source.PVC.Name != second {
		t.Errorf("the DataSource lost its import: %+v %v", pointsAtStill, err)
	}
}
