// Package dataimportcron is CDI's DataImportCron controller in the brain:
// on each cron's schedule it asks the registry which digest the source's
// tag names, imports a new digest into a DataVolume of its own
// (<dataSource>-<digest prefix>, pinned to that digest), points the
// managed DataSource at the newest import that succeeded, keeps
// importsToKeep imports (garbageCollect Outdated) and reports
// currentImports, lastImportedPVC, lastExecutionTimestamp and the
// UpToDate/Progressing conditions. It also keeps every DataSource's Ready
// condition. A registry that cannot be reached shows on UpToDate and is
// asked again at the next scheduled time, never in a tight loop.
package dataimportcron

import (
	"context"
	"errors"
	"fmt"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"log/slog"
	"net/netip"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry"
)

// Labels and defaults (CDI's).
const (
	LabelCron            = "cdi.kubevirt.io/dataImportCron"
	DefaultImportsToKeep = 3
	reasonUpToDate       = "UpToDate"
	reasonOutdated       = "OutOfDate"
	reasonImporting      = "ImportProgressing"
	reasonNoImport       = "NoImport"
	reasonPollFailed     = "PollFailed"
	reasonInvalid        = "InvalidSpec"
)

// DigestResolver tells which digest a registry source names now.
type DigestResolver interface {
	Digest(ctx context.Context, namespace string, src *cdiv1.DataVolumeSourceRegistry) (string, error)
}

// Registry resolves digests over the OCI distribution API, with the CDI
// CR's insecure registries and the networks imports may reach.
type Registry struct {
	Virt *client.Set
}

var _ DigestResolver = Registry{}

// Digest implements DigestResolver.
func (r Registry) Digest(ctx context.Context, _ string, src *cdiv1.DataVolumeSourceRegistry) (string, error) {
	if src.URL == nil || *src.URL == "" {
		return "", errors.New("only registry url sources are polled")
	}
	rs := registry.Source{URL: *src.URL}
	cdis, err := r.Virt.CDIs.List(ctx, "", metav1.ListOptions{})
	if err == nil && len(cdis) > 0 {
		if cdis[0].Spec.Config != nil {
			rs.InsecureRegistries = cdis[0].Spec.Config.InsecureRegistries
		}
		var allowed []netip.Prefix
		if allowed, err = reach.ParseNetworks(cdis[0].Annotations[importstate.AnnImportAllowedNetworks]); err == nil {
			rs.AllowedNetworks = allowed
		}
	}
	return registry.ResolveDigest(ctx, rs)
}

// Config configures the controller.
type Config struct {
	Virt     *client.Set
	Resolver DigestResolver
	Log      *slog.Logger
	// Now is the clock (default time.Now).
	Now func() time.Time
	// Resync re-reads everything periodically (default 10m).
	Resync time.Duration
}

// Controller is the DataImportCron role.
type Controller struct {
	cfg   Config
	queue *controller.Queue
}

// New defaults and validates cfg.
func New(cfg Config) (*Controller, error) {
	if cfg.Virt == nil {
		return nil, errors.New("dataimportcron: virt client is required")
	}
	if cfg.Resolver == nil {
		cfg.Resolver = Registry{Virt: cfg.Virt}
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Resync == 0 {
		cfg.Resync = 10 * time.Minute
	}
	c := &Controller{cfg: cfg}
	var err error
	c.queue, err = controller.New(controller.Config{Name: "dataimportcron", Sync: c.sync,
		Backoff: controller.BackoffAPI, Workers: 2, Log: cfg.Log})
	return c, err
}

// Name implements the brain's Role.
func (c *Controller) Name() string { return "dataimportcron" }

// Keys: "cron/ns/name" and "ds/ns/name".
func (c *Controller) enqueue(kind string) func(any) {
	return func(obj any) {
		if k, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			c.queue.Add(kind + "/" + k)
		}
	}
}

// Run watches crons, their DataVolumes and the DataSources until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	v, rs := c.cfg.Virt, c.cfg.Resync
	crons := v.DataImportCrons.Informer("", rs, nil)
	dvs := v.DataVolumes.Informer("", rs, func(o *metav1.ListOptions) { o.LabelSelector = LabelCron })
	dss := v.DataSources.Informer("", rs, nil)
	onCron, onDS := c.enqueue("cron"), c.enqueue("ds")
	handlers := []struct {
		inf cache.SharedIndexInformer
		f   func(any)
	}{
		{crons, onCron},
		{dss, onDS},
		{dvs, func(obj any) {
			// A DataVolume's cron, and the DataSources that may name it.
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if dv, ok := obj.(*cdiv1.DataVolume); ok {
				if name := dv.Labels[LabelCron]; name != "" {
					c.queue.Add("cron/" + dv.Namespace + "/" + name)
				}
				for _, o := range dss.GetStore().List() {
					if ds := o.(*cdiv1.DataSource); ds.Spec.Source.PVC != nil && ds.Spec.Source.PVC.Namespace == dv.Namespace && ds.Spec.Source.PVC.Name == dv.Name {
						onDS(ds)
					}
				}
			}
		}},
	}
	for _, h := range handlers {
		if _, err := h.inf.AddEventHandler(controller.OnChange(h.f)); err != nil {
			return err
		}
		go h.inf.RunWithContext(ctx)
	}
	return c.queue.Run(ctx, crons.HasSynced, dvs.HasSynced, dss.HasSynced)
}

// sync reconciles one key: "cron/ns/name" (again after the cron's next
// scheduled time) or "ds/ns/name".
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	kind, rest, _ := strings.Cut(key, "/")
	ns, name, _ := cache.SplitMetaNamespaceKey(rest)
	if kind == "cron" {
		return c.SyncCron(ctx, ns, name)
	}
	return 0, c.SyncDataSource(ctx, ns, name)
}

// DataVolumeName is the import of digest for the managed DataSource ds.
func DataVolumeName(ds, digest string) string {
	hex := strings.TrimPrefix(digest, "sha256:")
	if len(hex) > 12 {
		hex = hex[:12]
	}
	name := ds + "-" + hex
	if len(name) > 63 {
		name = name[len(name)-63:]
	}
	return name
}

// SyncCron polls the source when due, imports a new digest, updates the
// DataSource and status, and collects old imports; it returns when to
// come back (the next scheduled time).
func (c *Controller) SyncCron(ctx context.Context, ns, name string) (time.Duration, error) {
	v := c.cfg.Virt
	cron, err := v.DataImportCrons.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("get dataimportcron: %w", err)
	}
	if cron.DeletionTimestamp != nil {
		return 0, nil
	}
	log := c.cfg.Log.With("namespace", ns, "name", name)
	st := cron.Status.DeepCopy()
	now := c.cfg.Now()
	sched, err := ParseSchedule(cron.Spec.Schedule)
	src := cron.Spec.Template.Spec.Source
	if err == nil && (src == nil || src.Registry == nil) {
		err = errors.New("spec.template.spec.source.registry is required")
	}
	if err == nil && cron.Spec.ManagedDataSource == "" {
		err = errors.New("spec.managedDataSource is required")
	}
	if err != nil {
		setCond(st, cdiv1.DataImportCronUpToDate, corev1.ConditionFalse, reasonInvalid, err.Error(), now)
		setCond(st, cdiv1.DataImportCronProgressing, corev1.ConditionFalse, reasonInvalid, err.Error(), now)
		return 0, c.writeStatus(ctx, cron, st)
	}

	// Poll when due: at once for a new cron, then on schedule.
	due := st.LastExecutionTimestamp == nil || !sched.Next(st.LastExecutionTimestamp.Time).After(now)
	// A failed poll stands until the next poll: syncs in between (the
	// status write, a DataVolume event) must not call the cron up to date.
	pollFailed := !due && reasonOf(st, cdiv1.DataImportCronUpToDate) == reasonPollFailed
	if due {
		t := metav1.NewTime(now)
		st.LastExecutionTimestamp = &t
		digest, err := c.cfg.Resolver.Digest(ctx, ns, src.Registry)
		if err != nil {
			log.Warn("poll registry", "err", err)
			pollFailed = true
			setCond(st, cdiv1.DataImportCronUpToDate, corev1.ConditionFalse, reasonPollFailed, "cannot read the source's digest: "+err.Error(), now)
		} else if len(st.CurrentImports) == 0 || st.CurrentImports[0].Digest != digest {
			dvName := DataVolumeName(cron.Spec.ManagedDataSource, digest)
			if err := c.ensureImport(ctx, cron, dvName, digest); err != nil {
				return 0, err
			}
			log.Info("importing new digest", "digest", digest, "datavolume", dvName)
			st.CurrentImports = []cdiv1.ImportStatus{{DataVolumeName: dvName, Digest: digest}}
		}
	}

	// The current import's state.
	if len(st.CurrentImports) > 0 {
		cur := st.CurrentImports[0]
		dv, err := v.DataVolumes.Get(ctx, ns, cur.DataVolumeName)
		switch {
		case apierrors.IsNotFound(err):
			// Deleted by someone: import it again.
			if err := c.ensureImport(ctx, cron, cur.DataVolumeName, cur.Digest); err != nil {
				return 0, err
			}
			setCond(st, cdiv1.DataImportCronProgressing, corev1.ConditionTrue, reasonImporting, "importing "+cur.Digest, now)
		case err != nil:
			return 0, fmt.Errorf("get datavolume: %w", err)
		case dv.Status.Phase == cdiv1.Succeeded:
			if st.LastImportedPVC == nil || st.LastImportedPVC.Name != dv.Name {
				t := metav1.NewTime(now)
				st.LastImportTimestamp = &t
			}
			st.LastImportedPVC = &cdiv1.DataVolumeSourcePVC{Namespace: ns, Name: dv.Name}
			pvc := cdiv1.DataImportCronSourceFormatPvc
			st.SourceFormat = &pvc
			setCond(st, cdiv1.DataImportCronProgressing, corev1.ConditionFalse, reasonNoImport, "no import in progress", now)
			if !pollFailed {
				setCond(st, cdiv1.DataImportCronUpToDate, corev1.ConditionTrue, reasonUpToDate, "the latest digest "+cur.Digest+" is imported", now)
			}
		case dv.Status.Phase == cdiv1.Failed:
			setCond(st, cdiv1.DataImportCronProgressing, corev1.ConditionFalse, "ImportFailed", "import of "+cur.Digest+" failed", now)
			setCond(st, cdiv1.DataImportCronUpToDate, corev1.ConditionFalse, reasonOutdated, "import of "+cur.Digest+" failed", now)
		default:
			setCond(st, cdiv1.DataImportCronProgressing, corev1.ConditionTrue, reasonImporting, "importing "+cur.Digest, now)
			setCond(st, cdiv1.DataImportCronUpToDate, corev1.ConditionFalse, reasonOutdated, "importing "+cur.Digest, now)
		}
	} else if cond(st, cdiv1.DataImportCronUpToDate) == nil {
		setCond(st, cdiv1.DataImportCronUpToDate, corev1.ConditionFalse, reasonNoImport, "no digest read yet", now)
	}

	if err := c.ensureDataSource(ctx, cron, st.LastImportedPVC); err != nil {
		return 0, err
	}
	if err := c.collect(ctx, cron, st); err != nil {
		return 0, err
	}
	if err := c.writeStatus(ctx, cron, st); err != nil {
		return 0, err
	}
	next := sched.Next(st.LastExecutionTimestamp.Time)
	if next.IsZero() {
		return 0, nil
	}
	wait := next.Sub(now)
	if wait < time.Second {
		wait = time.Second
	}
	return wait, nil
}

// ensureImport creates the DataVolume importing digest, pinned to it.
func (c *Controller) ensureImport(ctx context.Context, cron *cdiv1.DataImportCron, name, digest string) error {
	spec := cron.Spec.Template.Spec.DeepCopy()
	reg := spec.Source.Registry
	if reg.URL != nil {
		pinned := pin(*reg.URL, digest)
		reg.URL = &pinned
	}
	dv := &cdiv1.DataVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: cron.Namespace,
			Labels:      merge(cron.Spec.Template.Labels, map[string]string{LabelCron: cron.Name}),
			Annotations: merge(cron.Spec.Template.Annotations, cron.Annotations),
		},
		Spec: *spec,
	}
	if retainNone(cron) {
		dv.OwnerReferences = []metav1.OwnerReference{owner(cron)}
	}
	if _, err := c.cfg.Virt.DataVolumes.Create(ctx, dv); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create datavolume %s: %w", name, err)
	}
	return nil
}

// pin replaces the tag of docker://host/repo[:tag] with @digest.
func pin(url, digest string) string {
	if i := strings.Index(url, "@"); i >= 0 {
		url = url[:i]
	}
	slash := strings.LastIndex(url, "/")
	if colon := strings.LastIndex(url, ":"); colon > slash {
		url = url[:colon]
	}
	return url + "@" + digest
}

func retainNone(cron *cdiv1.DataImportCron) bool {
	return cron.Spec.RetentionPolicy != nil && *cron.Spec.RetentionPolicy == cdiv1.DataImportCronRetainNone
}

func owner(cron *cdiv1.DataImportCron) metav1.OwnerReference {
	return metav1.OwnerReference{APIVersion: cdiv1.SchemeGroupVersion.String(), Kind: "DataImportCron", Name: cron.Name, UID: cron.UID}
}

func merge(ms ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		for k, v := range m {
			if k == "kubectl.kubernetes.io/last-applied-configuration" {
				continue
			}
			out[k] = v
		}
	}
	return out
}

// ensureDataSource makes the managed DataSource name the last import (or
// nothing yet).
func (c *Controller) ensureDataSource(ctx context.Context, cron *cdiv1.DataImportCron, pvc *cdiv1.DataVolumeSourcePVC) error {
	v := c.cfg.Virt
	name := cron.Spec.ManagedDataSource
	ds, err := v.DataSources.Get(ctx, cron.Namespace, name)
	if apierrors.IsNotFound(err) {
		ds = &cdiv1.DataSource{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: cron.Namespace, Labels: map[string]string{LabelCron: cron.Name}}}
		if pvc != nil {
			ds.Spec.Source.PVC = pvc.DeepCopy()
		}
		if retainNone(cron) {
			ds.OwnerReferences = []metav1.OwnerReference{owner(cron)}
		}
		if _, err := v.DataSources.Create(ctx, ds); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create datasource %s: %w", name, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("get datasource %s: %w", name, err)
	}
	if pvc == nil || ds.Spec.Source.PVC != nil && *ds.Spec.Source.PVC == *pvc && ds.Labels[LabelCron] == cron.Name {
		return nil
	}
	upd := ds.DeepCopyObject().(*cdiv1.DataSource)
	upd.Spec.Source = cdiv1.DataSourceSource{PVC: pvc.DeepCopy()}
	if upd.Labels == nil {
		upd.Labels = map[string]string{}
	}
	upd.Labels[LabelCron] = cron.Name
	if _, err := v.DataSources.Update(ctx, upd); err != nil {
		return fmt.Errorf("point datasource %s at %s: %w", name, pvc.Name, err)
	}
	c.cfg.Log.Info("datasource points at the newest import", "namespace", cron.Namespace, "name", name, "pvc", pvc.Name)
	return nil
}

// collect deletes the cron's oldest imports beyond importsToKeep, never
// the current one or the one the DataSource names.
func (c *Controller) collect(ctx context.Context, cron *cdiv1.DataImportCron, st *cdiv1.DataImportCronStatus) error {
	if cron.Spec.GarbageCollect != nil && *cron.Spec.GarbageCollect == cdiv1.DataImportCronGarbageCollectNever {
		return nil
	}
	keep := DefaultImportsToKeep
	if cron.Spec.ImportsToKeep != nil {
		keep = int(*cron.Spec.ImportsToKeep)
	}
	dvs, err := c.cfg.Virt.DataVolumes.List(ctx, cron.Namespace, metav1.ListOptions{LabelSelector: LabelCron + "=" + cron.Name})
	if err != nil {
		return fmt.Errorf("list imports: %w", err)
	}
	sort.Slice(dvs, func(i, j int) bool {
		a, b := dvs[i].CreationTimestamp, dvs[j].CreationTimestamp
		if a.Equal(&b) {
			return dvs[i].Name > dvs[j].Name
		}
		return b.Before(&a)
	})
	protected := map[string]bool{}
	for _, ci := range st.CurrentImports {
		protected[ci.DataVolumeName] = true
	}
	if st.LastImportedPVC != nil {
		protected[st.LastImportedPVC.Name] = true
	}
	kept := 0
	for _, dv := range dvs {
		if kept < keep || protected[dv.Name] {
			kept++
			continue
		}
		if err := c.cfg.Virt.DataVolumes.Delete(ctx, dv.Namespace, dv.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("collect import %s: %w", dv.Name, err)
		}
		c.cfg.Log.Info("collected old import", "namespace", dv.Namespace, "datavolume", dv.Name, "cron", cron.Name)
	}
	return nil
}

func (c *Controller) writeStatus(ctx context.Context, cron *cdiv1.DataImportCron, st *cdiv1.DataImportCronStatus) error {
	if equalJSON(cron.Status, *st) {
		return nil
	}
	upd := cron.DeepCopy()
	upd.Status = *st
	if _, err := c.cfg.Virt.DataImportCrons.UpdateStatus(ctx, upd); err != nil {
		return fmt.Errorf("update dataimportcron status: %w", err)
	}
	return nil
}

func cond(st *cdiv1.DataImportCronStatus, t cdiv1.DataImportCronConditionType) *cdiv1.DataImportCronCondition {
	for i := range st.Conditions {
		if st.Conditions[i].Type == t {
			return &st.Conditions[i]
		}
	}
	return nil
}

func setCond(st *cdiv1.DataImportCronStatus, t cdiv1.DataImportCronConditionType, s corev1.ConditionStatus, reason, msg string, now time.Time) {
	c := cond(st, t)
	if c == nil {
		st.Conditions = append(st.Conditions, cdiv1.DataImportCronCondition{Type: t})
		c = &st.Conditions[len(st.Conditions)-1]
	}
	if c.Status != s {
		c.LastTransitionTime = metav1.NewTime(now)
	}
	c.Status, c.Reason, c.Message = s, reason, msg
}

// reasonOf is the reason of st's condition of type t, "" when it has none.
func reasonOf(st *cdiv1.DataImportCronStatus, t cdiv1.DataImportCronConditionType) string {
	if c := cond(st, t); c != nil {
		return c.Reason
	}
	return ""
}
