// Package nodereads is how a node agent reads the Secrets and ConfigMaps
// its work needs, and nothing else: what the Node authorizer does for
// kubelets (a node reads only what the pods bound to it reference), for
// nodevirt's nodes, on any cluster.
//
// Nodes have no RBAC on Secrets or ConfigMaps at all. They ask the brain's
// aggregated API Group/Version, through kube-apiserver (which
// authenticates the node — its certificate's system:node:<node>, or the
// node agents' ServiceAccount with a token bound to a pod on <node> — and
// lets it "get" the subresources below), naming the object that refers to
// what they read:
//
//	GET /apis/nodereads.nodevirt.io/v1/namespaces/{ns}/{referrer}/{name}/{what}/{object}
//
//	referrer                  what             served when
//	virtualmachineinstances   secrets          the VMI runs on the node, or the node is the target of its
//	                          configmaps       migration, and its spec names object (cloud-init,
//	                                           volumes, containerDisk pull secrets, sysprep, access credentials)
//	datavolumes               secrets          the DataVolume's claim is placed on the node and its source
//	                          configmaps       names object (secretRef, secretExtraHeaders, certConfigMap)
//	datavolumes               brainconfigmaps  as above, and object is the CDI configuration's import proxy CA
//	                                           (trustedCAProxy, kept in the brain's namespace)
//	persistentvolumeclaims    brainconfigmaps  object is the claim's clone request (importstate), and the
//	                                           claim or the request's source claim is placed on the node
//
// The answer is the object itself (core/v1 Secret or ConfigMap), read with
// the brain's credentials; a refusal is a Kubernetes Status: 403 when the
// referrer is not the node's or does not name the object, 404 when the
// referrer or the object does not exist. Who owns what: the brain serves
// (clusterbrain/nodereads), the node agent calls Client; both compile this
// contract in.
package nodereads

import (
	"context"
	"fmt"
	"net/url"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
)

// The API.
const (
	Group   = "nodereads.nodevirt.io"
	Version = "v1"
)

// Referrers.
const (
	VMIs        = "virtualmachineinstances"
	DataVolumes = "datavolumes"
	Claims      = "persistentvolumeclaims"
)

// What a referrer's subresource reads.
const (
	Secrets    = "secrets"
	ConfigMaps = "configmaps"
	// BrainConfigMaps are ConfigMaps of the brain's namespace: clone
	// requests and the import proxy's CA.
	BrainConfigMaps = "brainconfigmaps"
)

// Subresources are the "<referrer>/<what>" pairs the API serves: what a
// node's RBAC grants "get" on.
var Subresources = []string{
	VMIs + "/" + Secrets, VMIs + "/" + ConfigMaps,
	DataVolumes + "/" + Secrets, DataVolumes + "/" + ConfigMaps, DataVolumes + "/" + BrainConfigMaps,
	Claims + "/" + BrainConfigMaps,
}

// Ref names the object that refers to what is read.
type Ref struct {
	// Resource is VMIs, DataVolumes or Claims.
	Resource        string
	Namespace, Name string
}

func (r Ref) String() string { return r.Resource + " " + r.Namespace + "/" + r.Name }

// Path is the request path of what/object read through ref.
func Path(ref Ref, what, object string) string {
	return "/apis/" + Group + "/" + Version + "/namespaces/" + url.PathEscape(ref.Namespace) + "/" + ref.Resource + "/" +
		url.PathEscape(ref.Name) + "/" + what + "/" + url.PathEscape(object)
}

// Reader reads what a node's referrers name. Errors are Kubernetes API
// errors (apierrors.IsNotFound, IsForbidden work on them).
type Reader interface {
	// Secret is the Secret name of ref's namespace that ref names.
	Secret(ctx context.Context, ref Ref, name string) (*corev1.Secret, error)
	// ConfigMap is the ConfigMap name of ref's namespace that ref names.
	ConfigMap(ctx context.Context, ref Ref, name string) (*corev1.ConfigMap, error)
	// BrainConfigMap is the ConfigMap name of the brain's namespace that
	// ref needs (its clone request, or the import proxy's CA).
	BrainConfigMap(ctx context.Context, ref Ref, name string) (*corev1.ConfigMap, error)
}

var (
	_ Reader = (*Client)(nil)
	_ Reader = Direct{}
)

// Client is the node agents' Reader: the brain's API through kube-apiserver.
type Client struct {
	rest rest.Interface
}

// NewClient builds a Client on the node's own credentials.
func NewClient(rc *rest.Config) (*Client, error) {
	c := rest.CopyConfig(rc)
	c.GroupVersion = &schema.GroupVersion{Group: Group, Version: Version}
	c.APIPath = "/apis"
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	rc2, err := rest.UnversionedRESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("nodereads client: %w", err)
	}
	return &Client{rest: rc2}, nil
}

func (c *Client) get(ctx context.Context, ref Ref, what, name string, into runtime.Object) error {
	return c.rest.Get().AbsPath(Path(ref, what, name)).Do(ctx).Into(into)
}

// Secret implements Reader.
func (c *Client) Secret(ctx context.Context, ref Ref, name string) (*corev1.Secret, error) {
	out := &corev1.Secret{}
	return out, c.get(ctx, ref, Secrets, name, out)
}

// ConfigMap implements Reader.
func (c *Client) ConfigMap(ctx context.Context, ref Ref, name string) (*corev1.ConfigMap, error) {
	out := &corev1.ConfigMap{}
	return out, c.get(ctx, ref, ConfigMaps, name, out)
}

// BrainConfigMap implements Reader.
func (c *Client) BrainConfigMap(ctx context.Context, ref Ref, name string) (*corev1.ConfigMap, error) {
	out := &corev1.ConfigMap{}
	return out, c.get(ctx, ref, BrainConfigMaps, name, out)
}

// Direct reads the objects straight from the API with Core's credentials,
// checking nothing: for callers whose credentials may read them anyway
// (the brain, an administrator, tests of a role without a brain). A node's
// own credentials cannot: nodes have no RBAC on Secrets or ConfigMaps.
type Direct struct {
	Core interface {
		CoreV1() typedcorev1.CoreV1Interface
	}
	// BrainNamespace holds the brain's ConfigMaps.
	BrainNamespace string
}

// Secret implements Reader.
func (d Direct) Secret(ctx context.Context, ref Ref, name string) (*corev1.Secret, error) {
	return d.Core.CoreV1().Secrets(ref.Namespace).Get(ctx, name, metav1.GetOptions{})
}

// ConfigMap implements Reader.
func (d Direct) ConfigMap(ctx context.Context, ref Ref, name string) (*corev1.ConfigMap, error) {
	return d.Core.CoreV1().ConfigMaps(ref.Namespace).Get(ctx, name, metav1.GetOptions{})
}

// BrainConfigMap implements Reader.
func (d Direct) BrainConfigMap(ctx context.Context, _ Ref, name string) (*corev1.ConfigMap, error) {
	return d.Core.CoreV1().ConfigMaps(d.BrainNamespace).Get(ctx, name, metav1.GetOptions{})
}
