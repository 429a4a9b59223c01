// Package dvimport is the nodeagent's DataVolume role (CDI's importer,
// cloner and upload server without pods): it fills the volumes of this node
// that DataVolumes ask for. For every DataVolume whose PVC is bound to a PV
// on this node it resolves the PV's volume to its disk, imports the source
// there (http, registry, blank, a clone of a volume on this node or, over
// mutual TLS, on another), and for an upload source serves the upload over
// mutual TLS to the brain's upload proxy. It also serves its volumes to the
// nodes that clone them. It reports through annotations on the PVC (see importstate); the
// brain turns them into the DataVolume's status. Deleting the DataVolume
// cancels its import.
package dvimport

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// Config configures the role.
type Config struct {
	// NodeName is this node's name (required).
	NodeName string
	Kube     kube.Interface
	Virt     *client.Set
	// Informers are the claim and volume informers, shared with other
	// roles; nil makes the role its own (then Run also stops them).
	Informers *kube.Factory
	// Resolver finds volumes' disks (required).
	Resolver VolumeResolver
	// Reads gives the Secrets and ConfigMaps DataVolumes name and the
	// brain's clone requests: the brain's nodereads API for an agent
	// (nodes have no RBAC on Secrets or ConfigMaps); nil reads them
	// directly with Kube's credentials.
	Reads nodereads.Reader
	// BrainNamespace holds the upload CA Secret and the import proxy's
	// trusted CA ConfigMap (default kubevirt-hyperconverged).
	BrainNamespace string
	// UploadAddr is where the upload endpoint listens (":8445"); empty
	// disables uploads on this node.
	UploadAddr string
	// UploadAdvertiseIP is the address published on the Node for the upload
	// proxy; empty means the listen address's host, or this host's first
	// global IPv4 address when that is unspecified.
	UploadAdvertiseIP string
	// MaxRestarts is how many times a failing import is tried again
	// (default 3; negative means never).
	MaxRestarts int
	// RetryDelay is the wait before the first retry, doubled each time
	// (default 2s).
	RetryDelay time.Duration
	// UploadTLS serves the upload endpoint: the node's own certificate,
	// client certificates verified against the node CA. Nil: a serving
	// certificate minted from the node CA (which needs read access to its
	// key).
	UploadTLS *tls.Config
	// UploadTLSProfile is the CDI CR's TLS settings for the upload endpoint
	// (minimum version and suites), applied at every handshake; nil: TLS
	// 1.2 and Go's suites.
	UploadTLSProfile *tlsprofile.Live
	// PeerTLS gives the client configuration for other nodes' endpoints
	// (clones across nodes): this node's certificate and the node CA. Nil:
	// a client certificate minted from the node CA.
	PeerTLS func(context.Context) (*tls.Config, error)
	// HTTPRetries and HTTPRetryDelay tune the importer's own retries of a
	// failing HTTP source within one attempt (0: the importer's defaults,
	// negative retries: none).
	HTTPRetries    int
	HTTPRetryDelay time.Duration
	// ProgressInterval is the shortest time between progress reports
	// (default 1s).
	ProgressInterval time.Duration
	// Resync re-reads every object this often (default 10 minutes).
	Resync time.Duration
	Log    *slog.Logger
}

func (c *Config) defaults() {
	if c.BrainNamespace == "" {
		c.BrainNamespace = "kubevirt-hyperconverged"
	}
	if c.MaxRestarts == 0 {
		c.MaxRestarts = 3
	}
	if c.RetryDelay == 0 {
		c.RetryDelay = 2 * time.Second
	}
	if c.ProgressInterval == 0 {
		c.ProgressInterval = time.Second
	}
	if c.Resync == 0 {
		c.Resync = 10 * time.Minute
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Reads == nil && c.Kube != nil {
		c.Reads = nodereads.Direct{Core: c.Kube, BrainNamespace: c.BrainNamespace}
	}
}

func (c *Config) validate() error {
	switch {
	case c.NodeName == "":
		return errors.New("dvimport: NodeName is required")
	case c.Kube == nil || c.Virt == nil:
		return errors.New("dvimport: Kube and Virt clients are required")
	case c.Resolver == nil:
		return errors.New("dvimport: a VolumeResolver is required")
	}
	return nil
}

// Agent is the running role.
type Agent struct {
	cfg  Config
	log  *slog.Logger
	kube kube.Interface
	virt *client.Set

	dvInformer cache.SharedIndexInformer
	factory    *kube.Factory
	release    func() // shuts down the factory if it is the agent's own
	pvcs       corelisters.PersistentVolumeClaimLister
	pvs        corelisters.PersistentVolumeLister
	synced     []cache.InformerSynced
	queue      *controller.Queue

	peerMu sync.Mutex
	peer   *tls.Config // minted peer client configuration, see peerTLS

	mu   sync.Mutex
	jobs map[string]*job // by DataVolume key; imports, clones and running uploads

	upload *uploadServer
}

// New validates cfg and builds the role; Run starts it.
func New(cfg Config) (*Agent, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	a := &Agent{
		cfg: cfg, log: cfg.Log.With("role", "dvimport", "node", cfg.NodeName), kube: cfg.Kube, virt: cfg.Virt,
		jobs: map[string]*job{},
	}
	var err error
	a.queue, err = controller.New(controller.Config{Name: "dvimport", Sync: controller.NoRequeue(a.sync),
		Backoff: controller.BackoffAPI, Workers: 2, Log: a.log, KeyAttr: "datavolume"})
	if err != nil {
		return nil, err
	}
	a.dvInformer = cfg.Virt.DataVolumes.Informer("", cfg.Resync, nil)
	a.factory, a.release = kube.Use(cfg.Informers, cfg.Kube, cfg.Resync)
	pvcInformer := a.factory.Claims()
	pvInformer := a.factory.Volumes()
	a.pvcs, a.pvs = pvcInformer.Lister(), pvInformer.Lister()
	a.synced = []cache.InformerSynced{a.dvInformer.HasSynced, pvcInformer.Informer().HasSynced, pvInformer.Informer().HasSynced}

	handlers := controller.OnChange(a.queue.Enqueue)
	_, _ = a.dvInformer.AddEventHandler(handlers)
	// A PVC has its DataVolume's name.
	_, _ = pvcInformer.Informer().AddEventHandler(handlers)
	// A PV names its claim.
	enqueueClaim := func(obj any) {
		if pv, ok := obj.(*corev1.PersistentVolume); ok && pv.Spec.ClaimRef != nil {
			a.queue.Add(pv.Spec.ClaimRef.Namespace + "/" + pv.Spec.ClaimRef.Name)
		}
	}
	_, _ = pvInformer.Informer().AddEventHandler(controller.OnAddOrUpdate(enqueueClaim))
	if cfg.UploadAddr != "" {
		a.upload = &uploadServer{a: a}
	}
	return a, nil
}

// Name is the role's name.
func (a *Agent) Name() string { return "dvimport" }

// Run runs the role until ctx ends; running imports are canceled then and
// resumed (as a restart) by the next run.
func (a *Agent) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer a.queue.ShutDown()
	go a.dvInformer.RunWithContext(ctx)
	a.factory.Start(ctx.Done())
	defer a.release()
	if !cache.WaitForCacheSync(ctx.Done(), a.synced...) {
		return fmt.Errorf("dvimport: caches did not sync: %w", ctx.Err())
	}
	errc := make(chan error, 1)
	if a.upload != nil {
		if err := a.upload.start(ctx); err != nil {
			return err
		}
		go func() { errc <- a.upload.serve(ctx) }()
	}
	a.log.Info("started", "uploads", a.upload != nil)
	workers := make(chan struct{})
	go func() { _ = a.queue.Run(ctx); close(workers) }()
	select {
	case <-ctx.Done():
	case err := <-errc:
		if ctx.Err() == nil {
			return fmt.Errorf("upload endpoint: %w", err)
		}
	}
	<-workers
	a.waitJobs()
	return nil
}

// target is a DataVolume, or a bare upload claim, whose volume is on this
// node.
type target struct {
	key      string
	dv       *cdiv1.DataVolume // nil for a bare upload claim
	pvc      *corev1.PersistentVolumeClaim
	kind     string
	disk     string
	isBlock  bool
	capacity int64
}

func (t *target) log(l *slog.Logger) *slog.Logger {
	if t.dv == nil {
		return l.With("namespace", t.pvc.Namespace, "pvc", t.pvc.Name)
	}
	return l.With("namespace", t.dv.Namespace, "datavolume", t.dv.Name)
}

// sync starts, keeps or cancels the work of one DataVolume or bare upload
// claim.
func (a *Agent) sync(ctx context.Context, key string) error {
	t, gone, err := a.targetOf(key)
	if gone {
		a.cancel(key, "datavolume or claim deleted")
		return nil
	}
	if err != nil || t == nil {
		return err
	}
	rep := importstate.Read(t.pvc)
	if j := a.job(key); j != nil {
		if j.pvcUID != t.pvc.UID {
			a.cancel(key, "claim replaced")
			a.queue.AddAfter(key, time.Second)
		}
		return nil
	}
	if rep.Phase == corev1.PodSucceeded || rep.Phase == corev1.PodFailed {
		return nil
	}
	switch t.kind {
	case importstate.SourceNone:
		return nil
	case importstate.SourceSnapshot:
		// The provisioner restored the snapshot when it made the volume.
		t.log(a.log).Info("restored from snapshot")
		return a.report(ctx, t, importstate.Report{Phase: corev1.PodSucceeded, Node: a.cfg.NodeName,
			Reason: "Completed", Progress: "100.0%"})
	case importstate.SourceUpload:
		if a.upload == nil {
			return a.report(ctx, t, importstate.Report{Phase: corev1.PodFailed, Node: a.cfg.NodeName,
				Reason: "UploadUnavailable", Message: "node " + a.cfg.NodeName + " serves no uploads"})
		}
		if rep.Phase != corev1.PodRunning || !rep.Ready || rep.Node != a.cfg.NodeName {
			t.log(a.log).Info("upload target ready")
			return a.report(ctx, t, importstate.Report{Phase: corev1.PodRunning, Ready: true, Restarts: rep.Restarts,
				Node: a.cfg.NodeName, Reason: rep.Reason, Message: rep.Message})
		}
		return nil
	case importstate.SourceHTTP, importstate.SourceRegistry, importstate.SourceBlank, importstate.SourcePVC:
		a.startJob(t, rep)
		return nil
	default:
		return a.report(ctx, t, importstate.Report{Phase: corev1.PodFailed, Node: a.cfg.NodeName,
			Reason: "UnsupportedSource", Message: "source " + t.kind + " is not supported"})
	}
}

// targetOf returns the work of key if its volume is on this node: the
// DataVolume's of that key, else the bare upload claim's. gone says that
// neither exists (any running work is to be canceled).
func (a *Agent) targetOf(key string) (t *target, gone bool, err error) {
	obj, exists, err := a.dvInformer.GetIndexer().GetByKey(key)
	if err != nil {
		return nil, false, err
	}
	if exists {
		dv := obj.(*cdiv1.DataVolume)
		if dv.DeletionTimestamp != nil {
			return nil, true, nil
		}
		t, err := a.target(dv, dv.Namespace, dv.Name)
		return t, false, err
	}
	ns, name, _ := strings.Cut(key, "/")
	pvc, err := a.pvcs.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) || err == nil && (!importstate.IsBareUploadClaim(pvc) || pvc.DeletionTimestamp != nil) {
		return nil, true, nil
	}
	if err != nil {
		return nil, false, err
	}
	t, err = a.target(nil, ns, name)
	return t, false, err
}

// target returns the work of the claim ns/name, of dv or (dv nil) a bare
// upload claim, if its volume is bound to a PV on this node, else nil.
func (a *Agent) target(dv *cdiv1.DataVolume, ns, name string) (*target, error) {
	pvc, err := a.pvcs.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	owned := dv == nil && importstate.IsBareUploadClaim(pvc) || dv != nil && metav1.IsControlledBy(pvc, dv)
	if !owned || pvc.Status.Phase != corev1.ClaimBound || pvc.Spec.VolumeName == "" {
		return nil, nil
	}
	pv, err := a.pvs.Get(pvc.Spec.VolumeName)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	node := importstate.PVNode(pv)
	if node == "" {
		node = pvc.Annotations[importstate.AnnSelectedNode]
	}
	if node != a.cfg.NodeName {
		return nil, nil
	}
	t := &target{key: ns + "/" + name, dv: dv, pvc: pvc, kind: pvc.Annotations[importstate.AnnSource]}
	if t.kind == "" || dv == nil && t.kind != importstate.SourceUpload {
		return nil, nil // not (yet) a claim the brain made or adopted
	}
	if pv.Spec.CSI == nil {
		return t, a.report(context.Background(), t, importstate.Report{Phase: corev1.PodFailed, Node: a.cfg.NodeName,
			Reason: "UnsupportedVolume", Message: fmt.Sprintf("pv %s is not a csi volume", pv.Name)})
	}
	disk, isBlock, capacity, err := a.cfg.Resolver.VolumeDisk(pv.Spec.CSI.VolumeHandle)
	if err != nil {
		return nil, fmt.Errorf("resolve volume %s of pv %s: %w", pv.Spec.CSI.VolumeHandle, pv.Name, err)
	}
	usable := importstate.UsableSize(pvc)
	if usable == 0 && !isBlock {
		// A claim the brain wrote no usable size on: the volume's,
		// net of the default overhead (the CDI CR is the brain's).
		if q, ok := pv.Spec.Capacity[corev1.ResourceStorage]; ok {
			usable = importstate.UsableOf(q.Value(), importstate.DefaultFilesystemOverhead)
		}
	}
	if capacity > 0 && (usable == 0 || capacity < usable) {
		usable = capacity
	}
	t.disk, t.isBlock, t.capacity = disk, isBlock, usable
	return t, nil
}

// report writes r onto the target's PVC.
func (a *Agent) report(ctx context.Context, t *target, r importstate.Report) error {
	_, err := a.kube.CoreV1().PersistentVolumeClaims(t.pvc.Namespace).Patch(ctx, t.pvc.Name, types.MergePatchType,
		r.Patch(t.pvc.UID), metav1.PatchOptions{})
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) || apierrors.IsInvalid(err) {
		// Gone, or replaced by a claim of the same name.
		return nil
	}
	if err != nil {
		return fmt.Errorf("report on pvc %s/%s: %w", t.pvc.Namespace, t.pvc.Name, err)
	}
	return nil
}
