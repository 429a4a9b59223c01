// Package datavolume is the DataVolume controller of the brain (CDI's
// cdi-controller without the pods): for every DataVolume it creates the PVC,
// decides where a claim that should not wait for its consumer goes, and
// turns what the node filling the volume reports (see importstate) into the
// DataVolume's phase, progress, conditions, restart count and events. It
// also keeps the StorageClass hostpath-csi and a StorageProfile for every
// StorageClass.
package datavolume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// Config configures the controller.
type Config struct {
	Kube kubernetes.Interface
	Virt *client.Set
	Log  *slog.Logger
	// Workers is the number of DataVolumes synced in parallel (default 2).
	Workers int
	// Resync re-reads every object this often (default 10 minutes).
	Resync time.Duration
	// SkipStorageClass leaves the StorageClass hostpath-csi and the
	// VolumeSnapshotClass hostpath-csi-snapclass alone (the StorageProfiles
	// are still kept).
	SkipStorageClass bool
	// Snapshots reads the VolumeSnapshots DataVolumes restore and keeps the
	// default VolumeSnapshotClass; nil fails snapshot sources.
	Snapshots *snapshotv1.Client
	// Namespace is the brain's namespace, where it writes the clone
	// requests nodes read (default kubevirt-hyperconverged).
	Namespace string
}

func (c *Config) defaults() {
	if c.Workers <= 0 {
		c.Workers = 2
	}
	if c.Resync == 0 {
		c.Resync = 10 * time.Minute
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Namespace == "" {
		c.Namespace = "kubevirt-hyperconverged"
	}
}

func (c *Config) validate() error {
	if c.Kube == nil || c.Virt == nil {
		return errors.New("datavolume: Kube and Virt clients are required")
	}
	return nil
}

// Controller reconciles DataVolumes and StorageProfiles.
type Controller struct {
	cfg      Config
	log      *slog.Logger
	kube     kubernetes.Interface
	virt     *client.Set
	recorder record.EventRecorder

	dvInformer cache.SharedIndexInformer
	factory    informers.SharedInformerFactory
	pvcs       corelisters.PersistentVolumeClaimLister
	classes    storagelisters.StorageClassLister
	synced     []cache.InformerSynced

	queue        workqueue.TypedRateLimitingInterface[string]
	profileQueue workqueue.TypedRateLimitingInterface[string]
}

// New validates cfg and builds the controller; Run starts it.
func New(cfg Config) (*Controller, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg: cfg, log: cfg.Log.With("role", "datavolume"), kube: cfg.Kube, virt: cfg.Virt,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "datavolumes"}),
		profileQueue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "storageprofiles"}),
	}
	c.dvInformer = cfg.Virt.DataVolumes.Informer("", cfg.Resync, nil)
	c.factory = informers.NewSharedInformerFactory(cfg.Kube, cfg.Resync)
	pvcInformer := c.factory.Core().V1().PersistentVolumeClaims()
	classInformer := c.factory.Storage().V1().StorageClasses()
	c.pvcs, c.classes = pvcInformer.Lister(), classInformer.Lister()
	c.synced = []cache.InformerSynced{c.dvInformer.HasSynced, pvcInformer.Informer().HasSynced, classInformer.Informer().HasSynced}

	enqueueDV := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			c.queue.Add(key)
		}
	}
	_, _ = c.dvInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueueDV, UpdateFunc: func(_, obj any) { enqueueDV(obj) }, DeleteFunc: enqueueDV,
	})
	enqueueOwner := func(obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		if ref := metav1.GetControllerOf(pvc); ref != nil && ref.Kind == "DataVolume" {
			c.queue.Add(pvc.Namespace + "/" + ref.Name)
		} else if importstate.IsBareUploadClaim(pvc) {
			c.queue.Add(uploadClaimKey + pvc.Namespace + "/" + pvc.Name)
		}
	}
	_, _ = pvcInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueueOwner, UpdateFunc: func(_, obj any) { enqueueOwner(obj) }, DeleteFunc: enqueueOwner,
	})
	enqueueClass := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			c.profileQueue.Add(key)
		}
	}
	_, _ = classInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueueClass, UpdateFunc: func(_, obj any) { enqueueClass(obj) }, DeleteFunc: enqueueClass,
	})
	return c, nil
}

// Name is the role's name.
func (c *Controller) Name() string { return "datavolume" }

// Run runs the controller until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()
	defer c.profileQueue.ShutDown()

	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.kube.CoreV1().Events("")})
	defer broadcaster.Shutdown()
	c.recorder = broadcaster.NewRecorder(client.NewScheme(), corev1.EventSource{Component: "nodevirt-datavolume"})

	if !c.cfg.SkipStorageClass {
		if err := c.ensureStorageClass(ctx); err != nil {
			return err
		}
	}
	if !c.cfg.SkipStorageClass && c.cfg.Snapshots != nil {
		go c.keepSnapshotClass(ctx)
	}
	go c.dvInformer.RunWithContext(ctx)
	c.factory.Start(ctx.Done())
	defer c.factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		return fmt.Errorf("datavolume: caches did not sync: %w", ctx.Err())
	}
	c.log.Info("started", "workers", c.cfg.Workers)
	for range c.cfg.Workers {
		go wait.UntilWithContext(ctx, c.worker, time.Second)
	}
	go wait.UntilWithContext(ctx, c.profileWorker, time.Second)
	go c.collectCloneRequests(ctx, time.Minute)
	<-ctx.Done()
	return nil
}

// keepSnapshotClass creates the default VolumeSnapshotClass once the
// snapshot API is served.
func (c *Controller) keepSnapshotClass(ctx context.Context) {
	_ = wait.PollUntilContextCancel(ctx, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		if err := c.ensureSnapshotClass(ctx); err != nil {
			c.log.Info("volumesnapshotclass not created yet", "err", err)
			return false, nil
		}
		return true, nil
	})
}

func (c *Controller) worker(ctx context.Context) {
	for {
		key, quit := c.queue.Get()
		if quit {
			return
		}
		sync := c.sync
		if strings.HasPrefix(key, uploadClaimKey) {
			sync = c.syncUploadClaim
		}
		after, err := sync(ctx, key)
		metrics.Reconciled("datavolume", err)
		switch {
		case err != nil:
			level := slog.LevelWarn
			if apierrors.IsConflict(err) {
				level = slog.LevelDebug // the cache was behind; the retry sees the new version
			}
			c.log.Log(ctx, level, "sync failed", "datavolume", key, "err", err)
			c.queue.AddRateLimited(key)
		case after > 0:
			c.queue.Forget(key)
			c.queue.AddAfter(key, after)
		default:
			c.queue.Forget(key)
		}
		c.queue.Done(key)
	}
}

func (c *Controller) profileWorker(ctx context.Context) {
	for {
		key, quit := c.profileQueue.Get()
		if quit {
			return
		}
		if err := c.syncProfile(ctx, key); err != nil {
			c.log.Warn("storage profile sync failed", "storageclass", key, "err", err)
			c.profileQueue.AddRateLimited(key)
		} else {
			c.profileQueue.Forget(key)
		}
		c.profileQueue.Done(key)
	}
}

// dataVolume returns the cached DataVolume of key, or nil.
func (c *Controller) dataVolume(key string) (*cdiv1.DataVolume, error) {
	obj, exists, err := c.dvInformer.GetIndexer().GetByKey(key)
	if err != nil || !exists {
		return nil, err
	}
	return obj.(*cdiv1.DataVolume), nil
}

// storageClass returns the named class from the cache, or nil.
func (c *Controller) storageClass(name string) *storagev1.StorageClass {
	if name == "" {
		return nil
	}
	sc, err := c.classes.Get(name)
	if err != nil {
		return nil
	}
	return sc
}
