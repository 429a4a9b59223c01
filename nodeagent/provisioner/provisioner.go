// Package provisioner is the node-local volume provisioner: for claims of a
// hostpath storage class whose selected node is this node, it makes the
// volume with the in-process CSI driver and creates a PV pre-bound to the
// claim (kube-controller-manager then binds it); when such a PV is released
// it deletes the volume per the reclaim policy. It serves the CSI
// provisioner name and the legacy hostPath one, like external-provisioner in
// node-deployment mode plus HPP's legacy provisioner.
package provisioner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/client-go/kubernetes/scheme"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// Volumes is what the provisioner needs from the CSI driver; *csi.Driver
// provides it. Without it nothing can be provisioned, so Config requires it.
type Volumes interface {
	CreateVolume(context.Context, *csispec.CreateVolumeRequest) (*csispec.CreateVolumeResponse, error)
	DeleteVolume(context.Context, *csispec.DeleteVolumeRequest) (*csispec.DeleteVolumeResponse, error)
	// VolumePath is the node directory of a filesystem volume.
	VolumePath(volumeID string) (string, error)
}

var _ Volumes = (*hostpath.Driver)(nil)

// Config configures a Provisioner.
type Config struct {
	// NodeName is this node; claims selected for it are provisioned here.
	NodeName string
	// Client talks to the API server.
	Client kube.Interface
	// Informers are the claim, volume and class informers, shared with
	// other roles; nil makes the provisioner its own (then Run also stops
	// them).
	Informers *kube.Factory
	// Driver makes and deletes the volumes.
	Driver Volumes
	// Snapshots locates the VolumeSnapshots claims are restored from; nil
	// refuses such claims with an event.
	Snapshots *snapshotv1.Client
	// Reads gives the brain's clone requests, which name the VolumeSnapshot
	// of another namespace a claim restores (the claim itself cannot); nil
	// refuses such claims with an event.
	Reads nodereads.Reader
	// Workers is the number of claims and volumes handled at once;
	// defaults to 2.
	Workers int
	// Resync re-examines every claim and volume this often; defaults to
	// 10 minutes.
	Resync time.Duration
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
	case c.Client == nil:
		return errors.New("kubernetes client is required")
	case c.Driver == nil:
		return errors.New("volume driver is required")
	}
	return nil
}

// Provisioner watches claims and volumes and keeps this node's share of
// them provisioned.
type Provisioner struct {
	cfg      Config
	log      *slog.Logger
	factory  *kube.Factory
	release  func() // shuts down the factory if it is the provisioner's own
	claims   corelisters.PersistentVolumeClaimLister
	volumes  corelisters.PersistentVolumeLister
	classes  storagelisters.StorageClassLister
	synced   []cache.InformerSynced
	queue    *controller.Queue
	recorder *controller.Recorder
}

// Queue keys carry their object kind.
const (
	claimPrefix  = "claim/"
	volumePrefix = "volume/"
)

// New validates cfg and wires the informers; Run starts them.
func New(cfg Config) (*Provisioner, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("provisioner config: %w", err)
	}
	factory, release := kube.Use(cfg.Informers, cfg.Client, cfg.Resync)
	claimInformer := factory.Claims()
	volumeInformer := factory.Volumes()
	classInformer := factory.StorageClasses()

	p := &Provisioner{
		cfg:      cfg,
		log:      cfg.Logger.With("node", cfg.NodeName),
		factory:  factory,
		release:  release,
		claims:   claimInformer.Lister(),
		volumes:  volumeInformer.Lister(),
		classes:  classInformer.Lister(),
		synced:   []cache.InformerSynced{claimInformer.Informer().HasSynced, volumeInformer.Informer().HasSynced, classInformer.Informer().HasSynced},
		recorder: controller.NewNodeRecorder(scheme.Scheme, "nodevirt-hostpath-provisioner", cfg.NodeName),
	}
	var err error
	p.queue, err = controller.New(controller.Config{Name: "hostpath-provisioner", Sync: controller.NoRequeue(p.sync),
		Backoff: controller.BackoffAPI, Workers: cfg.Workers, Log: p.log})
	if err != nil {
		return nil, err
	}

	enqueueClaim := func(obj any) {
		if pvc, ok := obj.(*corev1.PersistentVolumeClaim); ok && p.mayConcern(pvc) {
			p.queue.Add(claimPrefix + pvc.Namespace + "/" + pvc.Name)
		}
	}
	_, err = claimInformer.Informer().AddEventHandler(controller.OnAddOrUpdate(enqueueClaim))
	if err != nil {
		return nil, fmt.Errorf("watch claims: %w", err)
	}
	enqueueVolume := func(obj any) {
		if pv, ok := obj.(*corev1.PersistentVolume); ok {
			if _, ours := pvVolume(pv, cfg.NodeName); ours {
				p.queue.Add(volumePrefix + pv.Name)
			}
		}
	}
	_, err = volumeInformer.Informer().AddEventHandler(controller.OnAddOrUpdate(enqueueVolume))
	if err != nil {
		return nil, fmt.Errorf("watch volumes: %w", err)
	}
	// A class that appears late makes its waiting claims provisionable.
	onClass := func(obj any) {
		sc, ok := obj.(*storagev1.StorageClass)
		if !ok {
			return
		}
		if _, ours := kindOf(sc.Provisioner); !ours {
			return
		}
		pvcs, _ := p.claims.List(everything)
		for _, pvc := range pvcs {
			if storageClassName(pvc) == sc.Name {
				enqueueClaim(pvc)
			}
		}
	}
	_, err = classInformer.Informer().AddEventHandler(controller.OnAddOrUpdate(onClass))
	if err != nil {
		return nil, fmt.Errorf("watch storage classes: %w", err)
	}
	return p, nil
}

// mayConcern is a cheap filter: unbound claims selected for this node.
func (p *Provisioner) mayConcern(pvc *corev1.PersistentVolumeClaim) bool {
	if pvc.Spec.VolumeName != "" {
		return false
	}
	return pvc.Annotations[AnnSelectedNode] == p.cfg.NodeName || pvc.Annotations[AnnLegacyProvisionOnNode] == p.cfg.NodeName
}

// Run serves until ctx is done.
func (p *Provisioner) Run(ctx context.Context) error {
	defer p.queue.ShutDown()
	defer p.recorder.Start(p.cfg.Client)()

	p.factory.Start(ctx.Done())
	defer p.release()
	if !cache.WaitForCacheSync(ctx.Done(), p.synced...) {
		return fmt.Errorf("provisioner: caches did not sync: %w", ctx.Err())
	}
	p.log.Info("provisioner running", "provisioners", []string{CSIProvisionerName, LegacyProvisionerName})
	return p.queue.Run(ctx)
}

// sync syncs the claim or volume key names.
func (p *Provisioner) sync(ctx context.Context, key string) error {
	switch {
	case strings.HasPrefix(key, claimPrefix):
		return p.syncClaim(ctx, strings.TrimPrefix(key, claimPrefix))
	case strings.HasPrefix(key, volumePrefix):
		return p.syncVolume(ctx, strings.TrimPrefix(key, volumePrefix))
	}
	return nil
}
