package v1

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
)

// Client gives typed access to the three kinds over a dynamic client (the
// group is served by CRDs that nodevirt or external-snapshotter installs).
type Client struct {
	Snapshots Resource[*VolumeSnapshot]
	Contents  Resource[*VolumeSnapshotContent]
	Classes   Resource[*VolumeSnapshotClass]
}

// NewClient wraps dyn.
func NewClient(dyn dynamic.Interface) *Client {
	return &Client{
		Snapshots: Resource[*VolumeSnapshot]{dyn: dyn, gvr: SnapshotsResource, kind: "VolumeSnapshot",
			newList: func() runtime.Object { return &VolumeSnapshotList{} }},
		Contents: Resource[*VolumeSnapshotContent]{dyn: dyn, gvr: ContentsResource, kind: "VolumeSnapshotContent",
			newList: func() runtime.Object { return &VolumeSnapshotContentList{} }},
		Classes: Resource[*VolumeSnapshotClass]{dyn: dyn, gvr: ClassesResource, kind: "VolumeSnapshotClass",
			newList: func() runtime.Object { return &VolumeSnapshotClassList{} }},
	}
}

// Object is what every kind of the group is.
type Object interface {
	runtime.Object
	metav1.Object
}

// Resource is a typed client of one resource; cluster-scoped resources
// take "" as namespace.
type Resource[T Object] struct {
	dyn     dynamic.Interface
	gvr     schema.GroupVersionResource
	kind    string
	newList func() runtime.Object
}

func (r Resource[T]) in(ns string) dynamic.ResourceInterface {
	if ns == "" {
		return r.dyn.Resource(r.gvr)
	}
	return r.dyn.Resource(r.gvr).Namespace(ns)
}

func (r Resource[T]) typed(u *unstructured.Unstructured) (T, error) {
	var zero T
	out := reflect.New(reflect.TypeOf(zero).Elem()).Interface().(T)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, out); err != nil {
		return zero, fmt.Errorf("decode %s %s: %w", r.kind, u.GetName(), err)
	}
	return out, nil
}

func (r Resource[T]) untyped(obj T) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, fmt.Errorf("encode %s %s: %w", r.kind, obj.GetName(), err)
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(SchemeGroupVersion.String())
	u.SetKind(r.kind)
	return u, nil
}

func (r Resource[T]) result(u *unstructured.Unstructured, err error) (T, error) {
	if err != nil {
		var zero T
		return zero, err
	}
	return r.typed(u)
}

// Get reads one object.
func (r Resource[T]) Get(ctx context.Context, ns, name string) (T, error) {
	return r.result(r.in(ns).Get(ctx, name, metav1.GetOptions{}))
}

// List reads objects.
func (r Resource[T]) List(ctx context.Context, ns string, opts metav1.ListOptions) ([]T, error) {
	l, err := r.in(ns).List(ctx, opts)
	if err != nil {
		return nil, err
	}
	out := make([]T, 0, len(l.Items))
	for i := range l.Items {
		o, err := r.typed(&l.Items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	return out, nil
}

// Create creates obj.
func (r Resource[T]) Create(ctx context.Context, obj T) (T, error) {
	u, err := r.untyped(obj)
	if err != nil {
		var zero T
		return zero, err
	}
	return r.result(r.in(obj.GetNamespace()).Create(ctx, u, metav1.CreateOptions{}))
}

// Update replaces obj (optimistic concurrency by resourceVersion).
func (r Resource[T]) Update(ctx context.Context, obj T) (T, error) {
	u, err := r.untyped(obj)
	if err != nil {
		var zero T
		return zero, err
	}
	return r.result(r.in(obj.GetNamespace()).Update(ctx, u, metav1.UpdateOptions{}))
}

// UpdateStatus replaces obj's status subresource.
func (r Resource[T]) UpdateStatus(ctx context.Context, obj T) (T, error) {
	u, err := r.untyped(obj)
	if err != nil {
		var zero T
		return zero, err
	}
	return r.result(r.in(obj.GetNamespace()).UpdateStatus(ctx, u, metav1.UpdateOptions{}))
}

// Patch patches an object or one of its subresources.
func (r Resource[T]) Patch(ctx context.Context, ns, name string, pt types.PatchType, data []byte, subresources ...string) (T, error) {
	return r.result(r.in(ns).Patch(ctx, name, pt, data, metav1.PatchOptions{}, subresources...))
}

// Delete deletes an object.
func (r Resource[T]) Delete(ctx context.Context, ns, name string) error {
	return r.in(ns).Delete(ctx, name, metav1.DeleteOptions{})
}

// Informer is a shared informer of typed objects over all namespaces.
func (r Resource[T]) Informer(resync time.Duration) cache.SharedIndexInformer {
	var zero T
	example := reflect.New(reflect.TypeOf(zero).Elem()).Interface().(T)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			l, err := r.dyn.Resource(r.gvr).List(ctx, opts)
			if err != nil {
				return nil, err
			}
			data, err := l.MarshalJSON()
			if err != nil {
				return nil, fmt.Errorf("encode %s list: %w", r.kind, err)
			}
			out := r.newList()
			if err := json.Unmarshal(data, out); err != nil {
				return nil, fmt.Errorf("decode %s list: %w", r.kind, err)
			}
			return out, nil
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			w, err := r.dyn.Resource(r.gvr).Watch(ctx, opts)
			if err != nil {
				return nil, err
			}
			return watch.Filter(w, func(ev watch.Event) (watch.Event, bool) {
				if u, ok := ev.Object.(*unstructured.Unstructured); ok && ev.Type != watch.Error {
					o, err := r.typed(u)
					if err != nil {
						return ev, false
					}
					ev.Object = o
				}
				return ev, true
			}), nil
		},
	}
	return cache.NewSharedIndexInformer(lw, example, resync, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}

// ClaimSource returns the name of the VolumeSnapshot a claim is restored
// from (its dataSourceRef, else its dataSource), "" if none. A snapshot of
// another namespace (dataSourceRef.namespace) is returned with ok false.
func ClaimSource(pvc *corev1.PersistentVolumeClaim) (name string, ok bool) {
	if ds := pvc.Spec.DataSourceRef; ds != nil && ds.APIGroup != nil && *ds.APIGroup == GroupName && ds.Kind == "VolumeSnapshot" {
		if ds.Namespace != nil && *ds.Namespace != "" && *ds.Namespace != pvc.Namespace {
			return ds.Name, false
		}
		return ds.Name, true
	}
	if ds := pvc.Spec.DataSource; ds != nil && ds.APIGroup != nil && *ds.APIGroup == GroupName && ds.Kind == "VolumeSnapshot" {
		return ds.Name, true
	}
	return "", true
}

// AnnNode is the nodevirt annotation on a VolumeSnapshotContent that names
// the node whose hostpath pools hold the snapshot.
const AnnNode = "snapshot.nodevirt.io/node"

// Location is where a VolumeSnapshot's data is.
type Location struct {
	// Content is the bound VolumeSnapshotContent.
	Content string
	// Node holds the snapshot ("" when unknown).
	Node string
	// Driver is the content's CSI driver.
	Driver string
	// Handle is the CSI snapshot ID ("" until taken).
	Handle string
	// RestoreSize is the smallest volume the snapshot restores into, in
	// bytes (0 when unknown).
	RestoreSize int64
	// Ready says the snapshot can be restored from.
	Ready bool
	// Error is the snapshot's last error message, if any.
	Error string
}

// Locate finds the content, node and CSI snapshot of the VolumeSnapshot
// ns/name. A snapshot not bound to a content yet is an error.
func (c *Client) Locate(ctx context.Context, ns, name string) (Location, error) {
	vs, err := c.Snapshots.Get(ctx, ns, name)
	if err != nil {
		return Location{}, fmt.Errorf("volumesnapshot %s/%s: %w", ns, name, err)
	}
	var loc Location
	if vs.Status != nil && vs.Status.Error != nil && vs.Status.Error.Message != nil {
		loc.Error = *vs.Status.Error.Message
	}
	if vs.Status == nil || vs.Status.BoundVolumeSnapshotContentName == nil || *vs.Status.BoundVolumeSnapshotContentName == "" {
		if loc.Error != "" {
			return loc, fmt.Errorf("volumesnapshot %s/%s is not bound to a content: %s", ns, name, loc.Error)
		}
		return loc, fmt.Errorf("volumesnapshot %s/%s is not bound to a content yet", ns, name)
	}
	loc.Content = *vs.Status.BoundVolumeSnapshotContentName
	content, err := c.Contents.Get(ctx, "", loc.Content)
	if err != nil {
		return loc, fmt.Errorf("volumesnapshotcontent %s of %s/%s: %w", loc.Content, ns, name, err)
	}
	if content.Spec.VolumeSnapshotRef.Name != name || content.Spec.VolumeSnapshotRef.Namespace != ns {
		return loc, fmt.Errorf("volumesnapshotcontent %s is bound to %s/%s, not %s/%s", loc.Content,
			content.Spec.VolumeSnapshotRef.Namespace, content.Spec.VolumeSnapshotRef.Name, ns, name)
	}
	loc.Node, loc.Driver = content.Annotations[AnnNode], content.Spec.Driver
	if st := content.Status; st != nil {
		if st.SnapshotHandle != nil {
			loc.Handle = *st.SnapshotHandle
		}
		if st.RestoreSize != nil {
			loc.RestoreSize = *st.RestoreSize
		}
		loc.Ready = st.ReadyToUse != nil && *st.ReadyToUse
	}
	if vs.Status.RestoreSize != nil && loc.RestoreSize == 0 {
		loc.RestoreSize = vs.Status.RestoreSize.Value()
	}
	loc.Ready = loc.Ready && vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse && loc.Handle != ""
	return loc, nil
}
