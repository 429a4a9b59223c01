// Package ssp is the brain's SSP role: it keeps the common templates of
// every SSP CR (rendered by the hco role) in the SSP's
// spec.commonTemplates.namespace — created, versioned, edits reverted,
// removed with the SSP — and the SSP's boot sources (DataImportCrons from
// spec.commonTemplates.dataImportCronTemplates, crons.go), the pipeline
// tasks when asked (deployTektonTaskResources, tekton.go), and reports
// whether they are in place (the
// HyperConverged's SSP child follows that). The template.openshift.io API
// itself is package templateapi; the catalogue is package templates.
package ssp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"log/slog"
	"reflect"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
)

var storedGVR = schema.GroupVersionResource{Group: templates.StorageGroup, Version: templates.StorageVersion, Resource: templates.StorageResource}

// Config configures the role.
type Config struct {
	Kube    kubernetes.Interface
	Dynamic dynamic.Interface
	Virt    *client.Set
	Log     *slog.Logger
	// Resync re-reconciles periodically (default 10m).
	Resync time.Duration
}

// Role reconciles the common templates.
type Role struct {
	cfg   Config
	queue *controller.Queue

	mu      sync.Mutex
	state   error
	reverts int
}

// New defaults and validates cfg.
func New(cfg Config) (*Role, error) {
	if cfg.Kube == nil || cfg.Dynamic == nil || cfg.Virt == nil {
		return nil, errors.New("ssp: kube, dynamic and virt clients are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Resync == 0 {
		cfg.Resync = 10 * time.Minute
	}
	r := &Role{cfg: cfg, state: errors.New("not reconciled yet")}
	var err error
	r.queue, err = controller.New(controller.Config{Name: "ssp-templates", Sync: controller.NoRequeue(r.sync),
		Backoff: controller.BackoffAPI, Log: cfg.Log})
	return r, err
}

// sync runs Sync and keeps its outcome as the role's health; no SSP yet
// is a state, not a failure to retry.
func (r *Role) sync(ctx context.Context, _ string) error {
	err := r.Sync(ctx)
	r.mu.Lock()
	r.state = err
	r.mu.Unlock()
	if errors.Is(err, errNoSSP) {
		return nil
	}
	return err
}

// Name implements the brain's Role.
func (r *Role) Name() string { return "ssp-templates" }

// Health reports nil once every SSP's common templates are in place, else
// why not.
func (r *Role) Health() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state
}

// Reverts counts the edits of common templates that were reverted.
func (r *Role) Reverts() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reverts
}

const key = "common-templates"

// errNoSSP is the role's state before the hco role renders an SSP: not
// healthy, but nothing to retry (the SSP's creation wakes the role).
var errNoSSP = errors.New("no SSP asks for common templates")

// Run watches the SSP CRs and the stored templates and reconciles until
// ctx ends.
func (r *Role) Run(ctx context.Context) error {
	kick := controller.OnChange(func(any) { r.queue.Add(key) })
	ssps := r.cfg.Virt.SSPs.Informer("", r.cfg.Resync, nil)
	stored := cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = templates.LabelManagedBy + "=" + templates.ManagedBy
			return r.cfg.Dynamic.Resource(storedGVR).List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = templates.LabelManagedBy + "=" + templates.ManagedBy
			return r.cfg.Dynamic.Resource(storedGVR).Watch(ctx, o)
		},
	}, &unstructured.Unstructured{}, r.cfg.Resync, cache.Indexers{})
	crons := r.cfg.Virt.DataImportCrons.Informer("", r.cfg.Resync, func(o *metav1.ListOptions) { o.LabelSelector = cronSelector })
	for _, inf := range []cache.SharedIndexInformer{ssps, stored, crons} {
		if _, err := inf.AddEventHandler(kick); err != nil {
			return err
		}
		go inf.RunWithContext(ctx)
	}
	r.queue.Add(key)
	return r.queue.Run(ctx, ssps.HasSynced, stored.HasSynced, crons.HasSynced)
}

// Sync makes the stored templates match every SSP's rendering and removes
// the managed ones no SSP asks for.
func (r *Role) Sync(ctx context.Context) error {
	ssps, err := r.cfg.Virt.SSPs.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list ssps: %w", err)
	}
	if err := r.ensureRoles(ctx); err != nil {
		return err
	}
	want := map[string]map[string]any{} // namespace/name → stored template
	for _, s := range ssps {
		if s.DeletionTimestamp != nil {
			continue
		}
		ns := s.Spec.CommonTemplates.Namespace
		if ns == "" {
			continue
		}
		if err := r.ensureNamespace(ctx, ns); err != nil {
			return err
		}
		if err := r.ensureReaders(ctx, ns); err != nil {
			return err
		}
		for _, t := range templates.Render(ns) {
			t["apiVersion"], t["kind"] = templates.StorageGroup+"/"+templates.StorageVersion, templates.StorageKind
			want[ns+"/"+t["metadata"].(map[string]any)["name"].(string)] = t
		}
	}
	res := r.cfg.Dynamic.Resource(storedGVR)
	have, err := res.List(ctx, metav1.ListOptions{LabelSelector: templates.LabelManagedBy + "=" + templates.ManagedBy})
	if err != nil {
		return fmt.Errorf("list templates: %w", err)
	}
	seen := map[string]bool{}
	var errs []error
	for i := range have.Items {
		cur := &have.Items[i]
		k := cur.GetNamespace() + "/" + cur.GetName()
		w, ok := want[k]
		if !ok {
			if err := res.Namespace(cur.GetNamespace()).Delete(ctx, cur.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("delete template %s: %w", k, err))
			} else {
				r.cfg.Log.Info("removed common template", "namespace", cur.GetNamespace(), "name", cur.GetName())
			}
			continue
		}
		seen[k] = true
		if upd, drift := merge(cur.Object, w); drift {
			if _, err := res.Namespace(cur.GetNamespace()).Update(ctx, &unstructured.Unstructured{Object: upd}, metav1.UpdateOptions{}); err != nil {
				errs = append(errs, fmt.Errorf("revert template %s: %w", k, err))
				continue
			}
			r.mu.Lock()
			r.reverts++
			r.mu.Unlock()
			r.cfg.Log.Info("reverted common template", "namespace", cur.GetNamespace(), "name", cur.GetName())
		}
	}
	created := 0
	for k, w := range want {
		if seen[k] {
			continue
		}
		md := w["metadata"].(map[string]any)
		_, err := res.Namespace(md["namespace"].(string)).Create(ctx, &unstructured.Unstructured{Object: w}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			errs = append(errs, fmt.Errorf("create template %s: %w", k, err))
			continue
		}
		created++
	}
	if created > 0 {
		r.cfg.Log.Info("created common templates", "count", created, "version", templates.Version)
	}
	if err := r.syncCrons(ctx, ssps); err != nil {
		errs = append(errs, err)
	}
	if err := r.syncTekton(ctx, ssps); err != nil {
		errs = append(errs, err)
	}
	if len(ssps) == 0 && len(errs) == 0 {
		return errNoSSP
	}
	return errors.Join(errs...)
}

// merge returns cur with want's content, labels and annotations, and
// whether anything differed (an edit to revert, or an older version).
func merge(cur, want map[string]any) (map[string]any, bool) {
	out := runtime.DeepCopyJSON(cur)
	drift := false
	for _, f := range []string{"objects", "parameters", "message", "labels"} {
		if !jsonEqual(out[f], want[f]) {
			if want[f] == nil {
				delete(out, f)
			} else {
				out[f] = want[f]
			}
			drift = true
		}
	}
	md := out["metadata"].(map[string]any)
	wmd := want["metadata"].(map[string]any)
	for _, f := range []string{"labels", "annotations"} {
		have, _ := md[f].(map[string]any)
		if have == nil {
			have = map[string]any{}
			md[f] = have
		}
		for k, v := range wmd[f].(map[string]any) {
			if have[k] != v {
				have[k] = v
				drift = true
			}
		}
	}
	return out, drift
}

func (r *Role) ensureNamespace(ctx context.Context, ns string) error {
	_, err := r.cfg.Kube.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = r.cfg.Kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			err = nil
		}
	}
	if err != nil {
		return fmt.Errorf("namespace %s: %w", ns, err)
	}
	return nil
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return reflect.DeepEqual(x, y)
}
