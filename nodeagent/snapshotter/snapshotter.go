// Package snapshotter is the node's CSI snapshot role: for this node's
// hostpath volumes it plays the snapshot-controller and the csi-snapshotter
// of the Kubernetes CSI external-snapshotter. A VolumeSnapshot of a claim
// bound to a volume on this node is taken with the in-process CSI driver
// and bound to a VolumeSnapshotContent it creates (dynamic provisioning);
// a VolumeSnapshot naming an existing content whose snapshot this node
// holds is bound to it (pre-provisioned). Finalizers keep the objects until
// the CSI snapshot is deleted per the content's deletionPolicy.
package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// Snapshots is what the role needs from the CSI driver; *csi.Driver
// provides it. Without it nothing can be snapshotted, so Config requires
// it.
type Snapshots interface {
	CreateSnapshot(context.Context, *csispec.CreateSnapshotRequest) (*csispec.CreateSnapshotResponse, error)
	DeleteSnapshot(context.Context, *csispec.DeleteSnapshotRequest) (*csispec.DeleteSnapshotResponse, error)
	GetSnapshot(context.Context, *csispec.GetSnapshotRequest) (*csispec.GetSnapshotResponse, error)
}

var _ Snapshots = (*hostpath.Driver)(nil)

// Finalizers, external-snapshotter's names.
const (
	// SnapshotFinalizer keeps a VolumeSnapshot until its content is dealt
	// with.
	SnapshotFinalizer = "snapshot.storage.kubernetes.io/volumesnapshot-bound-protection"
	// ContentFinalizer keeps a VolumeSnapshotContent until its CSI
	// snapshot is deleted (or retained).
	ContentFinalizer = "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"
)

// Config configures a Snapshotter.
type Config struct {
	// NodeName is this node: snapshots of its volumes are taken here.
	NodeName string
	// Kube reads claims and volumes and records events.
	Kube kube.Interface
	// Informers are the claim and volume informers, shared with other
	// roles; nil makes the snapshotter its own (then Run also stops them).
	Informers *kube.Factory
	// Snapshots reads and writes the snapshot.storage.k8s.io objects.
	Snapshots *snapshotv1.Client
	// Driver takes and deletes the snapshots.
	Driver Snapshots
	// Workers defaults to 2; Resync to 10 minutes.
	Workers int
	Resync  time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

func (c *Config) defaults() {
	if c.Workers <= 0 {
		c.Workers = 2
	}
	if c.Resync <= 0 {
		c.Resync = 10 * time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *Config) validate() error {
	switch {
	case c.NodeName == "":
		return errors.New("node name is required")
	case c.Kube == nil:
		return errors.New("kubernetes client is required")
	case c.Snapshots == nil:
		return errors.New("snapshot client is required")
	case c.Driver == nil:
		return errors.New("snapshot driver is required")
	}
	return nil
}

// Snapshotter keeps this node's snapshots in step with their objects.
type Snapshotter struct {
	cfg       Config
	log       *slog.Logger
	factory   *kube.Factory
	release   func() // shuts down the factory if it is the snapshotter's own
	claims    corelisters.PersistentVolumeClaimLister
	volumes   corelisters.PersistentVolumeLister
	snapshots cache.SharedIndexInformer
	contents  cache.SharedIndexInformer
	classes   cache.SharedIndexInformer
	queue     *controller.Queue
	recorder  *controller.Recorder
}

// recordedRetry is how often a snapshot whose error is on its status is
// looked at again without a watched change.
const recordedRetry = time.Minute

// recordedError is an error already shown on the object's status.
type recordedError struct{ err error }

func (e *recordedError) Error() string { return e.err.Error() }
func (e *recordedError) Unwrap() error { return e.err }

// Queue keys carry their kind.
const (
	snapshotPrefix = "snapshot/"
	contentPrefix  = "content/"
)

// New validates cfg and wires the informers; Run starts them.
func New(cfg Config) (*Snapshotter, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("snapshotter config: %w", err)
	}
	// Events are about snapshots and contents (and core objects): their
	// kinds are all the recorder's scheme needs, not every built-in group.
	scheme := runtime.NewScheme()
	_ = corev1.AddToScheme(scheme)
	_ = snapshotv1.AddToScheme(scheme)
	factory, release := kube.Use(cfg.Informers, cfg.Kube, cfg.Resync)
	s := &Snapshotter{
		cfg:       cfg,
		log:       cfg.Logger.With("node", cfg.NodeName),
		factory:   factory,
		release:   release,
		claims:    factory.Claims().Lister(),
		volumes:   factory.Volumes().Lister(),
		snapshots: cfg.Snapshots.Snapshots.Informer(cfg.Resync),
		contents:  cfg.Snapshots.Contents.Informer(cfg.Resync),
		classes:   cfg.Snapshots.Classes.Informer(cfg.Resync),
		recorder:  controller.NewNodeRecorder(scheme, "nodevirt-csi-snapshotter", cfg.NodeName),
	}
	var err error
	s.queue, err = controller.New(controller.Config{Name: "snapshotter", Sync: s.sync,
		Backoff: controller.BackoffSlowLocal, Workers: cfg.Workers, Log: s.log})
	if err != nil {
		return nil, err
	}
	enqueueSnapshot := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			s.queue.Add(snapshotPrefix + key)
		}
	}
	if _, err := s.snapshots.AddEventHandler(controller.OnAddOrUpdate(enqueueSnapshot)); err != nil {
		return nil, fmt.Errorf("watch volumesnapshots: %w", err)
	}
	enqueueContent := func(obj any) {
		c, ok := obj.(*snapshotv1.VolumeSnapshotContent)
		if !ok || c.Spec.Driver != hostpath.DriverName {
			return
		}
		s.queue.Add(contentPrefix + c.Name)
		if ref := c.Spec.VolumeSnapshotRef; ref.Name != "" {
			s.queue.Add(snapshotPrefix + ref.Namespace + "/" + ref.Name)
		}
	}
	if _, err := s.contents.AddEventHandler(controller.OnAddOrUpdate(enqueueContent)); err != nil {
		return nil, fmt.Errorf("watch volumesnapshotcontents: %w", err)
	}
	// A claim that binds makes the snapshots of it takeable.
	onClaim := func(obj any) {
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok || pvc.Spec.VolumeName == "" {
			return
		}
		items, _ := s.snapshots.GetIndexer().ByIndex(cache.NamespaceIndex, pvc.Namespace)
		for _, item := range items {
			vs := item.(*snapshotv1.VolumeSnapshot)
			if src := vs.Spec.Source.PersistentVolumeClaimName; src != nil && *src == pvc.Name {
				s.queue.Add(snapshotPrefix + vs.Namespace + "/" + vs.Name)
			}
		}
	}
	if _, err := factory.Claims().Informer().AddEventHandler(controller.OnAddOrUpdate(onClaim)); err != nil {
		return nil, fmt.Errorf("watch claims: %w", err)
	}
	// A class that appears may resolve a recorded error.
	onClass := func(any) {
		for _, key := range s.snapshots.GetIndexer().ListKeys() {
			s.queue.Add(snapshotPrefix + key)
		}
	}
	if _, err := s.classes.AddEventHandler(controller.OnAddOrUpdate(onClass)); err != nil {
		return nil, fmt.Errorf("watch volumesnapshotclasses: %w", err)
	}
	return s, nil
}

// Run serves until ctx is done.
func (s *Snapshotter) Run(ctx context.Context) error {
	defer s.queue.ShutDown()
	defer s.recorder.Start(s.cfg.Kube)()
	if err := s.waitForAPI(ctx); err != nil {
		return nil // stopped before the API came
	}
	s.factory.Start(ctx.Done())
	defer s.release()
	for _, inf := range []cache.SharedIndexInformer{s.snapshots, s.contents, s.classes} {
		go inf.RunWithContext(ctx)
	}
	synced := []cache.InformerSynced{s.snapshots.HasSynced, s.contents.HasSynced, s.classes.HasSynced}
	for _, inf := range s.factory.WaitForCacheSync(ctx.Done()) {
		if !inf {
			return fmt.Errorf("snapshotter: caches did not sync: %w", ctx.Err())
		}
	}
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return fmt.Errorf("snapshotter: caches did not sync: %w", ctx.Err())
	}
	s.log.Info("snapshotter running", "driver", hostpath.DriverName)
	return s.queue.Run(ctx)
}

// apiPoll is how often the role looks for the snapshot API while the
// cluster does not serve it (the brain installs its CRDs when absent).
const apiPoll = 5 * time.Second

// waitForAPI returns once snapshot.storage.k8s.io is served, logging once
// while it is not, or with ctx's error.
func (s *Snapshotter) waitForAPI(ctx context.Context) error {
	logged := false
	return wait.PollUntilContextCancel(ctx, apiPoll, true, func(ctx context.Context) (bool, error) {
		_, err := s.cfg.Snapshots.Classes.List(ctx, "", metav1.ListOptions{Limit: 1})
		if err == nil {
			if logged {
				s.log.Info("snapshot API served")
			}
			return true, nil
		}
		if !logged {
			s.log.Warn("waiting for the snapshot.storage.k8s.io API", "err", err)
			logged = true
		}
		return false, nil
	})
}

// sync syncs the snapshot or content key names. An error already shown on
// the snapshot's status is retried after recordedRetry rather than backed
// off: the user or a class must change.
func (s *Snapshotter) sync(ctx context.Context, key string) (time.Duration, error) {
	var err error
	switch {
	case strings.HasPrefix(key, snapshotPrefix):
		err = s.syncSnapshot(ctx, strings.TrimPrefix(key, snapshotPrefix))
	case strings.HasPrefix(key, contentPrefix):
		err = s.syncContent(ctx, strings.TrimPrefix(key, contentPrefix))
	}
	if recorded := (*recordedError)(nil); errors.As(err, &recorded) {
		s.log.Info("snapshot error recorded", "key", key, "err", err)
		return recordedRetry, nil
	}
	return 0, err
}
