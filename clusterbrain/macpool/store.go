package macpool

import (
	"context"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/api/macpool/v1alpha1"
)

// store is the typed client of macallocations.nodevirt.io.
type store struct{ rc rest.Interface }

func newStore(cfg *rest.Config) (*store, error) {
	s := runtime.NewScheme()
	if err := macv1alpha1.AddToScheme(s); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	// Allocations are written on the admission path, whose rate the API
	// server sets; do not queue them behind the brain's own limit.
	c.QPS, c.Burst = 1000, 2000
	gv := macv1alpha1.SchemeGroupVersion
	c.GroupVersion, c.APIPath = &gv, "/apis"
	c.NegotiatedSerializer = serializer.NewCodecFactory(s).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("macallocations client: %w", err)
	}
	return &store{rc: rc}, nil
}

const allocResource = "macallocations"

func (s *store) create(ctx context.Context, a *macv1alpha1.MACAllocation) (*macv1alpha1.MACAllocation, error) {
	out := &macv1alpha1.MACAllocation{}
	return out, s.rc.Post().Resource(allocResource).Body(a).Do(ctx).Into(out)
}

func (s *store) get(ctx context.Context, name string) (*macv1alpha1.MACAllocation, error) {
	out := &macv1alpha1.MACAllocation{}
	return out, s.rc.Get().Resource(allocResource).Name(name).Do(ctx).Into(out)
}

func (s *store) update(ctx context.Context, a *macv1alpha1.MACAllocation) (*macv1alpha1.MACAllocation, error) {
	out := &macv1alpha1.MACAllocation{}
	return out, s.rc.Put().Resource(allocResource).Name(a.Name).Body(a).Do(ctx).Into(out)
}

// delete removes an allocation only if it is still exactly a (same UID
// and resourceVersion), so a concurrent re-claim is never lost.
func (s *store) delete(ctx context.Context, a *macv1alpha1.MACAllocation) error {
	uid, rv := a.UID, a.ResourceVersion
	opts := metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv}}
	return s.rc.Delete().Resource(allocResource).Name(a.Name).Body(&opts).Do(ctx).Error()
}

func (s *store) list(ctx context.Context) ([]macv1alpha1.MACAllocation, error) {
	out := &macv1alpha1.MACAllocationList{}
	err := s.rc.Get().Resource(allocResource).Do(ctx).Into(out)
	return out.Items, err
}

func (s *store) informer(resync time.Duration) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			out := &macv1alpha1.MACAllocationList{}
			err := s.rc.Get().Resource(allocResource).VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(out)
			return out, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.Watch = true
			return s.rc.Get().Resource(allocResource).VersionedParams(&opts, metav1.ParameterCodec).Watch(ctx)
		},
	}
	return cache.NewSharedIndexInformer(lw, &macv1alpha1.MACAllocation{}, resync, cache.Indexers{})
}
