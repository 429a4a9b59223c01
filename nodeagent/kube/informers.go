package kube

import (
	"context"
	"reflect"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
)

// Factory makes one shared informer per kind, created on first use and
// started by Start: roles that share a Factory share its caches and its
// watches. Several roles may call Start; only the Factory's owner calls
// Shutdown.
type Factory struct {
	client Interface
	resync time.Duration

	mu        sync.Mutex
	informers map[reflect.Type]cache.SharedIndexInformer
	started   map[reflect.Type]bool
	wg        sync.WaitGroup
}

// NewFactory returns a Factory whose informers resync every resync (none
// when 0).
func NewFactory(client Interface, resync time.Duration) *Factory {
	return &Factory{client: client, resync: resync,
		informers: map[reflect.Type]cache.SharedIndexInformer{}, started: map[reflect.Type]bool{}}
}

// informer returns the informer of obj's kind, making it with lw.
func (f *Factory) informer(obj runtime.Object, lw *cache.ListWatch) cache.SharedIndexInformer {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := reflect.TypeOf(obj)
	if inf, ok := f.informers[t]; ok {
		return inf
	}
	inf := cache.NewSharedIndexInformer(lw, obj, f.resync, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	f.informers[t] = inf
	return inf
}

// Claims is the informer of PersistentVolumeClaims in every namespace.
func (f *Factory) Claims() ClaimInformer {
	return ClaimInformer{f.informer(&corev1.PersistentVolumeClaim{}, &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return f.client.CoreV1().PersistentVolumeClaims(metav1.NamespaceAll).List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return f.client.CoreV1().PersistentVolumeClaims(metav1.NamespaceAll).Watch(ctx, o)
		},
	})}
}

// Volumes is the informer of PersistentVolumes.
func (f *Factory) Volumes() VolumeInformer {
	return VolumeInformer{f.informer(&corev1.PersistentVolume{}, &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return f.client.CoreV1().PersistentVolumes().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return f.client.CoreV1().PersistentVolumes().Watch(ctx, o)
		},
	})}
}

// StorageClasses is the informer of StorageClasses.
func (f *Factory) StorageClasses() StorageClassInformer {
	return StorageClassInformer{f.informer(&storagev1.StorageClass{}, &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return f.client.StorageV1().StorageClasses().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return f.client.StorageV1().StorageClasses().Watch(ctx, o)
		},
	})}
}

// Start runs every informer made so far that is not running yet, until
// stop closes.
func (f *Factory) Start(stop <-chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for t, inf := range f.informers {
		if f.started[t] {
			continue
		}
		f.started[t] = true
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			inf.Run(stop)
		}()
	}
}

// WaitForCacheSync waits until every started informer has synced or stop
// closes, and tells which synced.
func (f *Factory) WaitForCacheSync(stop <-chan struct{}) map[reflect.Type]bool {
	f.mu.Lock()
	started := map[reflect.Type]cache.SharedIndexInformer{}
	for t, inf := range f.informers {
		if f.started[t] {
			started[t] = inf
		}
	}
	f.mu.Unlock()
	res := map[reflect.Type]bool{}
	for t, inf := range started {
		res[t] = cache.WaitForCacheSync(stop, inf.HasSynced)
	}
	return res
}

// Shutdown waits until the started informers have stopped (their stop
// channel closed).
func (f *Factory) Shutdown() { f.wg.Wait() }

// Use returns shared when a role was given one, else a Factory of the
// role's own on client; release shuts down only a Factory Use made (a
// shared one is its maker's to shut down).
func Use(shared *Factory, client Interface, resync time.Duration) (f *Factory, release func()) {
	if shared != nil {
		return shared, func() {}
	}
	f = NewFactory(client, resync)
	return f, f.Shutdown
}

// ClaimInformer is the shared informer and lister of claims.
type ClaimInformer struct{ inf cache.SharedIndexInformer }

// Informer is the shared informer.
func (i ClaimInformer) Informer() cache.SharedIndexInformer { return i.inf }

// Lister lists from the informer's cache.
func (i ClaimInformer) Lister() corelisters.PersistentVolumeClaimLister {
	return corelisters.NewPersistentVolumeClaimLister(i.inf.GetIndexer())
}

// VolumeInformer is the shared informer and lister of volumes.
type VolumeInformer struct{ inf cache.SharedIndexInformer }

// Informer is the shared informer.
func (i VolumeInformer) Informer() cache.SharedIndexInformer { return i.inf }

// Lister lists from the informer's cache.
func (i VolumeInformer) Lister() corelisters.PersistentVolumeLister {
	return corelisters.NewPersistentVolumeLister(i.inf.GetIndexer())
}

// StorageClassInformer is the shared informer and lister of storage
// classes.
type StorageClassInformer struct{ inf cache.SharedIndexInformer }

// Informer is the shared informer.
func (i StorageClassInformer) Informer() cache.SharedIndexInformer { return i.inf }

// Lister lists from the informer's cache.
func (i StorageClassInformer) Lister() storagelisters.StorageClassLister {
	return storagelisters.NewStorageClassLister(i.inf.GetIndexer())
}
