// Package virtctl is the library behind nodevirt's virtctl: kubeconfig
// loading as kubectl does it, the subresources.kubevirt.io calls (the same
// requests upstream virtctl sends), console and VNC streams, and CDI image
// uploads.
//
// It is a client of the cluster's API, run on a user's machine (the virtctl
// command, the lab's demo), not part of the brain: it sits under
// clusterbrain/client because it speaks the brain's API, and neither daemon
// links it (clusterbrain/api's import-rule test checks that).
package virtctl

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/plainstream"
)

// SubresourceVersion is the version virtctl v1.x calls.
const SubresourceVersion = "v1"

// Client talks to one cluster as one user.
type Client struct {
	Config    *rest.Config
	Namespace string
	Kube      kubernetes.Interface
	Virt      *client.Set
	http      *http.Client
}

// Options select the kubeconfig, its context and the namespace, like
// kubectl's --kubeconfig, --context and -n.
type Options struct {
	Kubeconfig, Context, Namespace string
}

// Load builds a client with kubectl's loading rules: --kubeconfig, else
// $KUBECONFIG (a list), else ~/.kube/config, else in-cluster; the
// namespace comes from -n, else the context, else "default".
func Load(o Options) (*Client, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = o.Kubeconfig
	overrides := &clientcmd.ConfigOverrides{CurrentContext: o.Context}
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, overrides)
	rc, err := cc.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig: %w", err)
	}
	ns := o.Namespace
	if ns == "" {
		if ns, _, err = cc.Namespace(); err != nil {
			return nil, fmt.Errorf("namespace from kubeconfig: %w", err)
		}
	}
	return NewClient(rc, ns)
}

// NewClient builds a client from a rest config.
func NewClient(rc *rest.Config, namespace string) (*Client, error) {
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	virt, err := client.NewSet(rc)
	if err != nil {
		return nil, err
	}
	hc, err := rest.HTTPClientFor(rc)
	if err != nil {
		return nil, err
	}
	if namespace == "" {
		namespace = "default"
	}
	return &Client{Config: rc, Namespace: namespace, Kube: kube, Virt: virt, http: hc}, nil
}

// subresourceURL is /apis/subresources.kubevirt.io/v1/namespaces/{ns}/{resource}/{name}/{sub}.
func (c *Client) subresourceURL(resource, name, sub string, query url.Values) (*url.URL, error) {
	u, err := url.Parse(c.Config.Host)
	if err != nil {
		return nil, err
	}
	if u.Scheme == "" {
		u, err = url.Parse("https://" + c.Config.Host)
		if err != nil {
			return nil, err
		}
	}
	// The host may carry a path prefix (a proxied cluster): keep it.
	u.Path = path.Join("/", u.Path, "apis/subresources.kubevirt.io", SubresourceVersion, "namespaces", c.Namespace, resource, name, sub)
	u.RawQuery = query.Encode()
	return u, nil
}

// do sends one subresource request and decodes a JSON answer into out.
func (c *Client) do(ctx context.Context, method, resource, name, sub string, body, out any) error {
	u, err := c.subresourceURL(resource, name, sub, nil)
	if err != nil {
		return err
	}
	var rd io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return statusError(resp.StatusCode, data)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("decode %s answer: %w", sub, err)
		}
	}
	return nil
}

// statusError is the API error an answer carries.
func statusError(code int, body []byte) error {
	var st metav1.Status
	if json.Unmarshal(body, &st) == nil && st.Kind == "Status" {
		if st.Code == 0 {
			st.Code = int32(code)
		}
		return apierrors.FromObject(&st)
	}
	msg := strings.TrimSpace(string(body))
	if msg == "" {
		msg = http.StatusText(code)
	}
	return apierrors.NewGenericServerResponse(code, "", metav1.SchemeGroupVersion.WithResource("").GroupResource(), "", msg, 0, true)
}

// VM sends a PUT virtualmachines/{name}/{action} (start, stop, restart,
// migrate) with the options body virtctl sends.
func (c *Client) VM(ctx context.Context, name, action string, opts any) error {
	return c.do(ctx, http.MethodPut, "virtualmachines", name, action, opts, nil)
}

// VMI sends a PUT virtualmachineinstances/{name}/{action} (pause, unpause,
// softreboot).
func (c *Client) VMI(ctx context.Context, name, action string, opts any) error {
	return c.do(ctx, http.MethodPut, "virtualmachineinstances", name, action, opts, nil)
}

// GuestInfo reads virtualmachineinstances/{name}/{what} (guestosinfo,
// userlist, filesystemlist) into out.
func (c *Client) GuestInfo(ctx context.Context, name, what string, out any) error {
	return c.do(ctx, http.MethodGet, "virtualmachineinstances", name, what, nil, out)
}

// ExpandSpec returns virtualmachines/{name}/expand-spec.
func (c *Client) ExpandSpec(ctx context.Context, name string, out any) error {
	return c.do(ctx, http.MethodGet, "virtualmachines", name, "expand-spec", nil, out)
}

// ObjectGraph reads {resource}/{name}/objectgraph (virtualmachines or
// virtualmachineinstances) into out; opts, when not nil, is the
// ObjectGraphOptions body upstream's client sends with the GET.
func (c *Client) ObjectGraph(ctx context.Context, resource, name string, opts, out any) error {
	return c.do(ctx, http.MethodGet, resource, name, "objectgraph", opts, out)
}

// Version reads /apis/subresources.kubevirt.io/v1/version into out.
func (c *Client) Version(ctx context.Context, out any) error {
	u, err := url.Parse(c.Config.Host)
	if err != nil {
		return err
	}
	u.Path = path.Join("/", u.Path, "apis/subresources.kubevirt.io", SubresourceVersion, "version")
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return statusError(resp.StatusCode, data)
	}
	return json.Unmarshal(data, out)
}

// StreamError is a refused stream: the HTTP code and the API's reason.
type StreamError struct {
	Code int
	Err  error
}

func (e *StreamError) Error() string { return e.Err.Error() }
func (e *StreamError) Unwrap() error { return e.Err }

// Stream opens virtualmachineinstances/{name}/{kind} (console, vnc) as a
// plain.kubevirt.io websocket through kube-apiserver.
func (c *Client) Stream(ctx context.Context, name, kind string, query url.Values) (*plainstream.Stream, error) {
	return c.StreamOf(ctx, "virtualmachineinstances", name, kind, query)
}

// StreamOf opens resource/{name}/{sub} (virtualmachines or
// virtualmachineinstances; console, vnc, portforward/{port}[/{protocol}])
// as a plain.kubevirt.io websocket through kube-apiserver.
func (c *Client) StreamOf(ctx context.Context, resource, name, sub string, query url.Values) (*plainstream.Stream, error) {
	u, err := c.subresourceURL(resource, name, sub, query)
	if err != nil {
		return nil, err
	}
	switch u.Scheme {
	case "https":
		u.Scheme = "wss"
	case "http":
		u.Scheme = "ws"
	default:
		return nil, fmt.Errorf("unsupported protocol %s", u.Scheme)
	}
	tlsConfig, err := rest.TLSConfigFor(c.Config)
	if err != nil {
		return nil, err
	}
	header := http.Header{}
	if c.Config.BearerToken != "" {
		header.Set("Authorization", "Bearer "+c.Config.BearerToken)
	}
	if c.Config.Username != "" {
		req := &http.Request{Header: http.Header{}}
		req.SetBasicAuth(c.Config.Username, c.Config.Password)
		header.Set("Authorization", req.Header.Get("Authorization"))
	}
	s, resp, err := plainstream.Dial(ctx, u.String(), tlsConfig, header)
	if err != nil {
		if resp != nil {
			data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
			return nil, &StreamError{Code: resp.StatusCode, Err: statusError(resp.StatusCode, data)}
		}
		return nil, err
	}
	return s, nil
}
