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
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
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
	// Placer picks the node of a claim placed immediately (no clone or
	// snapshot source deciding it): the scheduler, so volumes follow the
	// VMIs' placement policy. Nil: the first eligible node by name (a
	// brain without a scheduler, as in tests).
	Placer VolumePlacer
}

// VolumePlacer picks a node for a volume nothing consumes yet.
type VolumePlacer interface {
	// PlaceVolume returns the best node fit accepts (fit says why a node
	// cannot take the volume, "" when it can). With no node, node is ""
	// and why counts the nodes by reason; ok is false when the placer
	// cannot decide yet.
	PlaceVolume(fit func(*corev1.Node) string) (node, why string, ok bool)
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
	recorder *controller.Recorder

	dvInformer cache.SharedIndexInformer
	factory    informers.SharedInformerFactory
	pvcs       corelisters.PersistentVolumeClaimLister
	classes    storagelisters.StorageClassLister
	synced     []cache.InformerSynced

	queue        *controller.Queue // DataVolumes and bare upload claims
	profileQueue *controller.Queue // StorageClasses, whose profiles follow them
}

// New validates cfg and builds the controller; Run starts it.
func New(cfg Config) (*Controller, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg: cfg, log: cfg.Log.With("role", "datavolume"), kube: cfg.Kube, virt: cfg.Virt,
		recorder: controller.NewRecorder(client.NewScheme(), "nodevirt-datavolume"),
	}
	var err error
	c.queue, err = controller.New(controller.Config{Name: "datavolumes", Sync: c.syncKey, Backoff: controller.BackoffAPI,
		Workers: cfg.Workers, Log: c.log, KeyAttr: "datavolume",
		Observe: func(err error) { metrics.Reconciled("datavolume", err) },
		Quiet:   apierrors.IsConflict, // the cache was behind; the retry sees the new version
	})
	if err != nil {
		return nil, err
	}
	c.profileQueue, err = controller.New(controller.Config{Name: "storageprofiles", Sync: controller.NoRequeue(c.syncProfile),
		Backoff: controller.BackoffAPI, Log: c.log, KeyAttr: "storageclass"})
	if err != nil {
		return nil, err
	}
	c.dvInformer = cfg.Virt.DataVolumes.Informer("", cfg.Resync, nil)
	c.factory = informers.NewSharedInformerFactory(cfg.Kube, cfg.Resync)
	pvcInformer := c.factory.Core().V1().PersistentVolumeClaims()
	classInformer := c.factory.Storage().V1().StorageClasses()
	c.pvcs, c.classes = pvcInformer.Lister(), classInformer.Lister()
	c.synced = []cache.InformerSynced{c.dvInformer.HasSynced, pvcInformer.Informer().HasSynced, classInformer.Informer().HasSynced}

	_, _ = c.dvInformer.AddEventHandler(controller.OnChange(c.queue.Enqueue))
	enqueueOwner := func(obj any) {
		if key, ok := controller.OwnerKey(obj, "DataVolume"); ok {
			c.queue.Add(key)
		} else if pvc, ok := obj.(*corev1.PersistentVolumeClaim); ok {
			c.enqueueClaim(pvc)
		}
	}
	_, _ = pvcInformer.Informer().AddEventHandler(controller.OnChange(enqueueOwner))
	_, _ = classInformer.Informer().AddEventHandler(controller.OnChange(c.profileQueue.Enqueue))
	_, _ = classInformer.Informer().AddEventHandler(controller.OnAddOrUpdate(c.enqueueClassClaims))
	return c, nil
}

// enqueueClaim queues a claim of no DataVolume: a bare upload claim, or a
// plain claim that waits for a node.
func (c *Controller) enqueueClaim(pvc *corev1.PersistentVolumeClaim) {
	switch {
	case importstate.IsBareUploadClaim(pvc):
		c.queue.Add(uploadClaimKey + pvc.Namespace + "/" + pvc.Name)
	case awaitsNode(pvc):
		c.queue.Add(plainClaimKey + pvc.Namespace + "/" + pvc.Name)
	}
}

// Name is the role's name.
func (c *Controller) Name() string { return "datavolume" }

// Run runs the controller until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()
	defer c.profileQueue.ShutDown()
	defer c.recorder.Start(c.kube)()

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
	go c.collectCloneRequests(ctx, time.Minute)
	var profiles sync.WaitGroup
	defer profiles.Wait()
	profiles.Go(func() { _ = c.profileQueue.Run(ctx) })
	return c.queue.Run(ctx)
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

// syncKey syncs a DataVolume, or a bare upload or plain claim when key
// says so.
func (c *Controller) syncKey(ctx context.Context, key string) (time.Duration, error) {
	switch {
	case strings.HasPrefix(key, uploadClaimKey):
		return c.syncUploadClaim(ctx, key)
	case strings.HasPrefix(key, plainClaimKey):
		return c.syncPlainClaim(ctx, key)
	}
	return c.sync(ctx, key)
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
