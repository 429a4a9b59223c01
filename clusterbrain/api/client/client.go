// Package client gives typed access to every kind nodevirt serves
// (KubeVirt, CDI, instance types, NADs and the operators' CRs) through one
// generic REST client per resource, plus informers on the same types.
package client

import (
	"context"
	"fmt"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
	poolv1beta1 "kubevirt.io/api/pool/v1beta1"
	vmsnapshotv1beta1 "kubevirt.io/api/snapshot/v1beta1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
	uploadv1beta1 "kubevirt.io/containerized-data-importer-api/pkg/apis/upload/v1beta1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	cnaov1 "github.com/nodevirt/nodevirt/clusterbrain/api/networkaddons/v1"
	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
)

// NewScheme returns a scheme with the Kubernetes built-ins and every
// nodevirt kind.
func NewScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		scheme.AddToScheme, kubevirtv1.AddToScheme, instancetypev1beta1.AddToScheme, cdiv1.AddToScheme,
		uploadv1beta1.AddToScheme, nadv1.AddToScheme, hcov1beta1.AddToScheme, cnaov1.AddToScheme,
		hppv1beta1.AddToScheme, sspv1beta2.AddToScheme, poolv1beta1.AddToScheme,
		vmsnapshotv1beta1.AddToScheme, clonev1beta1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err) // registration of static types cannot fail
		}
	}
	return s
}

// Object is what every typed resource is.
type Object interface {
	runtime.Object
	metav1.Object
}

// Resource is a typed client for one resource; T is a pointer type such as
// *kubevirtv1.VirtualMachineInstance.
type Resource[T Object] struct {
	rc       rest.Interface
	resource string
	newObj   func() T
	newList  func() runtime.Object
}

func newResource[T Object](cfg *rest.Config, s *runtime.Scheme, gv schema.GroupVersion, resource string, newObj func() T, newList func() runtime.Object) (Resource[T], error) {
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &gv
	c.APIPath = "/apis"
	c.NegotiatedSerializer = serializer.NewCodecFactory(s).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return Resource[T]{}, fmt.Errorf("client for %s: %w", resource, err)
	}
	return Resource[T]{rc: rc, resource: resource, newObj: newObj, newList: newList}, nil
}

func (r Resource[T]) req(verb, ns string) *rest.Request {
	return r.rc.Verb(verb).NamespaceIfScoped(ns, ns != "").Resource(r.resource)
}

// Get reads one object.
func (r Resource[T]) Get(ctx context.Context, ns, name string) (T, error) {
	out := r.newObj()
	err := r.req("GET", ns).Name(name).Do(ctx).Into(out)
	return out, err
}

// List reads objects.
func (r Resource[T]) List(ctx context.Context, ns string, opts metav1.ListOptions) ([]T, error) {
	list := r.newList()
	if err := r.req("GET", ns).VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(list); err != nil {
		return nil, err
	}
	items, err := meta.ExtractList(list)
	if err != nil {
		return nil, err
	}
	out := make([]T, 0, len(items))
	for _, it := range items {
		out = append(out, it.(T))
	}
	return out, nil
}

// Create creates obj in its namespace.
func (r Resource[T]) Create(ctx context.Context, obj T) (T, error) {
	out := r.newObj()
	err := r.req("POST", obj.GetNamespace()).Body(obj).Do(ctx).Into(out)
	return out, err
}

// Update replaces obj (optimistic concurrency by resourceVersion).
func (r Resource[T]) Update(ctx context.Context, obj T) (T, error) {
	out := r.newObj()
	err := r.req("PUT", obj.GetNamespace()).Name(obj.GetName()).Body(obj).Do(ctx).Into(out)
	return out, err
}

// UpdateStatus replaces obj's status subresource.
func (r Resource[T]) UpdateStatus(ctx context.Context, obj T) (T, error) {
	out := r.newObj()
	err := r.req("PUT", obj.GetNamespace()).Name(obj.GetName()).SubResource("status").Body(obj).Do(ctx).Into(out)
	return out, err
}

// Patch patches an object or one of its subresources.
func (r Resource[T]) Patch(ctx context.Context, ns, name string, pt types.PatchType, data []byte, opts metav1.PatchOptions, subresources ...string) (T, error) {
	out := r.newObj()
	err := r.req("PATCH", ns).Name(name).SubResource(subresources...).
		VersionedParams(&opts, metav1.ParameterCodec).Body(data).SetHeader("Content-Type", string(pt)).Do(ctx).Into(out)
	return out, err
}

// Delete deletes an object.
func (r Resource[T]) Delete(ctx context.Context, ns, name string, opts metav1.DeleteOptions) error {
	return r.req("DELETE", ns).Name(name).Body(&opts).Do(ctx).Error()
}

// Watch watches objects.
func (r Resource[T]) Watch(ctx context.Context, ns string, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return r.req("GET", ns).VersionedParams(&opts, metav1.ParameterCodec).Watch(ctx)
}

// Informer returns a new shared informer over ns ("" for all namespaces),
// narrowed by tweak when given (e.g. a field selector on the node name).
func (r Resource[T]) Informer(ns string, resync time.Duration, tweak func(*metav1.ListOptions)) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			if tweak != nil {
				tweak(&opts)
			}
			list := r.newList()
			err := r.req("GET", ns).VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(list)
			return list, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			if tweak != nil {
				tweak(&opts)
			}
			return r.Watch(ctx, ns, opts)
		},
	}
	return cache.NewSharedIndexInformer(lw, r.newObj(), resync, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}
