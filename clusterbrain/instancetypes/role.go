package instancetypes

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
)

// Config configures the role.
type Config struct {
	Virt *client.Set
	// Namespace holds the KubeVirt CR whose
	// spec.configuration.commonInstancetypesDeployment.enabled=false turns
	// the deployment off (as virt-operator honours it).
	Namespace string
	Log       *slog.Logger
	// Resync re-checks every object periodically (default 10m).
	Resync time.Duration
}

// Role installs the common instance types and preferences and keeps them
// as defined: edits are reverted, deleted objects come back.
type Role struct {
	cfg Config
}

// syncKey is the one key of the role's queue: a sync covers the whole
// catalogue.
const syncKey = "catalogue"

// settle lets a burst of events (the first sync's own writes) settle
// before the sync they call for.
const settle = 200 * time.Millisecond

// backoffCatalogue is the role's retry policy: 1 s doubling to 1 minute (a
// failed sync is a whole catalogue's worth of API calls).
var backoffCatalogue = controller.Backoff{Base: time.Second, Max: time.Minute}

// New validates cfg and builds the role.
func New(cfg Config) (*Role, error) {
	if cfg.Virt == nil {
		return nil, errors.New("instancetypes: virt client is required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Resync == 0 {
		cfg.Resync = 10 * time.Minute
	}
	return &Role{cfg: cfg}, nil
}

// Name implements the brain's Role.
func (r *Role) Name() string { return "common-instancetypes" }

// Run syncs at start, on every change of a managed object or of the
// KubeVirt CR, and every Resync, until ctx ends.
func (r *Role) Run(ctx context.Context) error {
	q, err := controller.New(controller.Config{Name: r.Name(), Backoff: backoffCatalogue, Log: r.cfg.Log,
		Sync: controller.NoRequeue(func(ctx context.Context, _ string) error {
			n, err := r.Sync(ctx)
			if n > 0 {
				r.cfg.Log.Info("common instance types synced", "written", n)
			}
			return err
		})})
	if err != nil {
		return err
	}
	kick := func(any) { q.AddAfter(syncKey, settle) }
	managed := func(o *metav1.ListOptions) { o.LabelSelector = LabelManagedBy + "=" + ManagedBy }
	v := r.cfg.Virt
	infs := []cache.SharedIndexInformer{
		v.ClusterInstancetypes.Informer("", r.cfg.Resync, managed),
		v.ClusterPreferences.Informer("", r.cfg.Resync, managed),
		v.KubeVirts.Informer(r.cfg.Namespace, r.cfg.Resync, nil),
	}
	var synced []cache.InformerSynced
	for _, inf := range infs {
		if _, err := inf.AddEventHandler(controller.OnChange(kick)); err != nil {
			q.ShutDown()
			return err
		}
		go inf.RunWithContext(ctx)
		synced = append(synced, inf.HasSynced)
	}
	kick(nil)
	if err := q.Run(ctx, synced...); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// Enabled reports whether the KubeVirt CRs of the namespace allow the
// deployment (true unless one sets commonInstancetypesDeployment.enabled
// to false).
func (r *Role) Enabled(ctx context.Context) (bool, error) {
	if r.cfg.Namespace == "" {
		return true, nil
	}
	kvs, err := r.cfg.Virt.KubeVirts.List(ctx, r.cfg.Namespace, metav1.ListOptions{})
	if err != nil {
		return false, fmt.Errorf("list kubevirts: %w", err)
	}
	for _, kv := range kvs {
		if d := kv.Spec.Configuration.CommonInstancetypesDeployment; d != nil && d.Enabled != nil && !*d.Enabled {
			return false, nil
		}
	}
	return true, nil
}

// Sync creates or restores every object (or removes them all when the
// deployment is disabled) and returns how many it wrote.
func (r *Role) Sync(ctx context.Context) (int, error) {
	on, err := r.Enabled(ctx)
	if err != nil {
		return 0, err
	}
	v := r.cfg.Virt
	if !on {
		return removeAll(ctx, r.cfg.Virt)
	}
	written := 0
	storedTypes, err := byName(ctx, v.ClusterInstancetypes)
	if err != nil {
		return 0, err
	}
	for _, it := range ClusterInstancetypes() {
		w, err := ensure(ctx, v.ClusterInstancetypes, storedTypes, it, func(o *instancetypev1beta1.VirtualMachineClusterInstancetype) any { return &o.Spec },
			func(dst, src *instancetypev1beta1.VirtualMachineClusterInstancetype) { dst.Spec = src.Spec })
		if err != nil {
			return written, err
		}
		written += w
	}
	prefs, err := ClusterPreferences()
	if err != nil {
		return written, err
	}
	storedPrefs, err := byName(ctx, v.ClusterPreferences)
	if err != nil {
		return written, err
	}
	for _, p := range prefs {
		w, err := ensure(ctx, v.ClusterPreferences, storedPrefs, p, func(o *instancetypev1beta1.VirtualMachineClusterPreference) any { return &o.Spec },
			func(dst, src *instancetypev1beta1.VirtualMachineClusterPreference) { dst.Spec = src.Spec })
		if err != nil {
			return written, err
		}
		written += w
	}
	return written, nil
}

// byName lists every object of a cluster-scoped resource in one request.
func byName[T client.Object](ctx context.Context, res client.Resource[T]) (map[string]T, error) {
	items, err := res.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list: %w", err)
	}
	out := make(map[string]T, len(items))
	for _, it := range items {
		out[it.GetName()] = it
	}
	return out, nil
}

// ensure creates want or brings the stored object's spec, labels and
// annotations back to it; it returns 1 when it wrote.
func ensure[T client.Object](ctx context.Context, res client.Resource[T], stored map[string]T, want T, specOf func(T) any, setSpec func(dst, src T)) (int, error) {
	got, ok := stored[want.GetName()]
	if !ok {
		if _, err := res.Create(ctx, want); err != nil && !apierrors.IsAlreadyExists(err) {
			return 0, fmt.Errorf("create %s: %w", want.GetName(), err)
		}
		return 1, nil
	}
	if apiequality.Semantic.DeepEqual(specOf(want), specOf(got)) && subset(want.GetLabels(), got.GetLabels()) &&
		subset(want.GetAnnotations(), got.GetAnnotations()) {
		return 0, nil
	}
	upd := got.DeepCopyObject().(T)
	setSpec(upd, want)
	upd.SetLabels(merged(got.GetLabels(), want.GetLabels()))
	upd.SetAnnotations(merged(got.GetAnnotations(), want.GetAnnotations()))
	if _, err := res.Update(ctx, upd); err != nil {
		return 0, fmt.Errorf("update %s: %w", want.GetName(), err)
	}
	return 1, nil
}

func subset(want, got map[string]string) bool {
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			return false
		}
	}
	return true
}

func merged(base, over map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range base {
		out[k] = v
	}
	for k, v := range over {
		out[k] = v
	}
	return out
}

// removeAll deletes every object the role manages.
func removeAll(ctx context.Context, v *client.Set) (int, error) {
	sel := metav1.ListOptions{LabelSelector: LabelManagedBy + "=" + ManagedBy}
	n := 0
	its, err := v.ClusterInstancetypes.List(ctx, "", sel)
	if err != nil {
		return 0, fmt.Errorf("list instance types: %w", err)
	}
	for _, it := range its {
		if err := v.ClusterInstancetypes.Delete(ctx, "", it.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return n, fmt.Errorf("delete %s: %w", it.Name, err)
		}
		n++
	}
	ps, err := v.ClusterPreferences.List(ctx, "", sel)
	if err != nil {
		return n, fmt.Errorf("list preferences: %w", err)
	}
	for _, p := range ps {
		if err := v.ClusterPreferences.Delete(ctx, "", p.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return n, fmt.Errorf("delete %s: %w", p.Name, err)
		}
		n++
	}
	return n, nil
}
