package subresources

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"sync"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/clusterbrain/api/tlsprofile"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
)

// BrainRole is the subresource API as a brain role: it installs KubeVirt's
// cluster roles, then serves.
type BrainRole struct {
	*Server
	kube kubernetes.Interface
}

// ForBrain builds the brain role from the brain's clients; the nodeagents'
// client certificate comes from the upload CA in namespace, loaded at the
// first node call; rollout is the KubeVirt CR's hotplug gates.
func ForBrain(rc *rest.Config, kube kubernetes.Interface, virt *client.Set, namespace, addr string, profile *tlsprofile.Live, rollout *live.Value[rollout.Cluster], log *slog.Logger) (*BrainRole, error) {
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	node := NewBrainNodeClient(kube, namespace)
	s, err := New(Config{Kube: kube, Dynamic: dyn, Virt: virt, Namespace: namespace, Addr: addr, Node: node, TLSProfile: profile, Rollout: rollout, Log: log})
	if err != nil {
		return nil, err
	}
	return &BrainRole{Server: s, kube: kube}, nil
}

// Run installs the cluster roles and serves until ctx ends.
func (b *BrainRole) Run(ctx context.Context) error {
	if err := rbac.Ensure(ctx, b.kube); err != nil {
		return fmt.Errorf("install kubevirt cluster roles: %w", err)
	}
	return b.Server.Run(ctx)
}

// NewBrainNodeClient is the brain's client of the node agents (the one
// the subresources use), for other roles; it is built on first use.
func NewBrainNodeClient(kube kubernetes.Interface, namespace string) NodeClient {
	return &lazyNodeClient{kube: kube, namespace: namespace}
}

// lazyNodeClient builds the HTTPS node client once the upload CA exists.
type lazyNodeClient struct {
	kube      kubernetes.Interface
	namespace string
	mu        sync.Mutex
	c         *HTTPSNodeClient
}

var _ NodeClient = (*lazyNodeClient)(nil)

func (l *lazyNodeClient) get(ctx context.Context) (*HTTPSNodeClient, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.c != nil {
		return l.c, nil
	}
	ca, err := uploadtls.EnsureCA(ctx, l.kube, l.namespace)
	if err != nil {
		return nil, fmt.Errorf("node client certificate authority: %w", err)
	}
	var cfg *tls.Config
	if cfg, err = NodeTLS(ca); err != nil {
		return nil, err
	}
	l.c = NewHTTPSNodeClient(l.kube, cfg)
	return l.c, nil
}

func (l *lazyNodeClient) Call(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, method, action string, body []byte) ([]byte, error) {
	c, err := l.get(ctx)
	if err != nil {
		return nil, err
	}
	return c.Call(ctx, vmi, method, action, body)
}

func (l *lazyNodeClient) Stream(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, action string, query url.Values) (io.ReadWriteCloser, error) {
	c, err := l.get(ctx)
	if err != nil {
		return nil, err
	}
	return c.Stream(ctx, vmi, action, query)
}
