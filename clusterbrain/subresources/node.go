package subresources

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/gorilla/websocket"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/plainstream"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
)

// The nodeagent side of the protocol, the same as virt-handler's console
// server: HTTPS with mutual TLS on the node, paths
// /v1/namespaces/{namespace}/virtualmachineinstances/{name}/{action}, with
//
//	PUT  pause | unpause | softreboot | unfreeze → 2xx, empty body
//	PUT  freeze (body: FreezeUnfreezeTimeout) → 2xx
//	GET  guestosinfo | userlist | filesystemlist → 200, JSON
//	GET  console | vnc (websocket, subprotocol plain.kubevirt.io, binary
//	     frames carrying the raw serial or RFB bytes)
//
// An error answer carries a Kubernetes Status (its code and message are
// passed to the caller) or plain text.
const (
	// PlainStreamProtocol is KubeVirt's websocket subprotocol for raw
	// binary streams.
	PlainStreamProtocol = plainstream.Protocol

	wsBufferSize = plainstream.BufferSize
)

// NodeClient reaches the nodeagent running a VMI (status.nodeName). Without
// an answering agent every call fails, and the subresource answers 500 with
// the reason.
type NodeClient interface {
	// Call sends method to the VMI's action path with body and returns the
	// body of a 2xx answer; other answers become API status errors with the
	// agent's code and message.
	Call(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, method, action string, body []byte) ([]byte, error)
	// Stream opens the VMI's console or vnc stream.
	Stream(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, action string, query url.Values) (io.ReadWriteCloser, error)
}

// HTTPSNodeClient is the NodeClient speaking the protocol above. It talks
// to a VMI's node only if the server's certificate names that very node
// (status.nodeName): the names every node certificate shares
// (identity.HandlerServerName) are not enough, so a node that redirects another node's
// endpoint to itself gets no console stream and no call.
type HTTPSNodeClient struct {
	kube kubernetes.Interface
	tls  *tls.Config

	mu      sync.Mutex
	clients map[string]*http.Client // by node name
}

var _ NodeClient = (*HTTPSNodeClient)(nil)

// NewHTTPSNodeClient finds agents through their Node objects and talks to
// them with tlsConfig (client certificate and the CA of the agents).
func NewHTTPSNodeClient(kube kubernetes.Interface, tlsConfig *tls.Config) *HTTPSNodeClient {
	return &HTTPSNodeClient{kube: kube, tls: tlsConfig, clients: map[string]*http.Client{}}
}

// tlsFor is the TLS configuration that accepts only node's certificate.
func (c *HTTPSNodeClient) tlsFor(node string) *tls.Config {
	cfg := c.tls.Clone()
	cfg.ServerName = node
	return cfg
}

// client is the HTTP client towards node.
func (c *HTTPSNodeClient) client(node string) *http.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	hc := c.clients[node]
	if hc == nil {
		hc = &http.Client{Timeout: 30 * time.Second,
			Transport: &http.Transport{TLSClientConfig: c.tlsFor(node), ForceAttemptHTTP2: false, MaxIdleConnsPerHost: 4}}
		c.clients[node] = hc
	}
	return hc
}

// NodeTLS builds the brain's mutual-TLS configuration towards nodeagents
// from the CA the brain and the agents share (the upload CA): a client
// certificate named identity.SubresourcesClientName; HTTPSNodeClient verifies each agent by its
// node name.
func NodeTLS(ca *uploadtls.CA) (*tls.Config, error) {
	cert, err := ca.Issue(identity.SubresourcesClientName, nil, nil, true)
	if err != nil {
		return nil, fmt.Errorf("issue subresources client certificate: %w", err)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: ca.Pool(), ServerName: identity.HandlerServerName,
		MinVersion: tls.VersionTLS12}, nil
}

// address resolves the agent of node.
func (c *HTTPSNodeClient) address(ctx context.Context, node string) (string, error) {
	if node == "" {
		return "", apierrors.NewBadRequest("VMI is not scheduled to a node")
	}
	n, err := c.kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "", apierrors.NewBadRequest(fmt.Sprintf("unable to find the nodeagent of node %s: %v", node, err))
	}
	if a := n.Annotations[identity.NodeAddressAnnotation]; a != "" {
		return a, nil
	}
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			return net.JoinHostPort(a.Address, strconv.Itoa(identity.HandlerPort)), nil
		}
	}
	return "", apierrors.NewBadRequest(fmt.Sprintf("node %s publishes no address for its nodeagent", node))
}

func actionPath(vmi *kubevirtv1.VirtualMachineInstance, action string) string {
	return fmt.Sprintf("/v1/namespaces/%s/virtualmachineinstances/%s/%s", url.PathEscape(vmi.Namespace), url.PathEscape(vmi.Name), action)
}

// Call implements NodeClient.
func (c *HTTPSNodeClient) Call(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, method, action string, body []byte) ([]byte, error) {
	addr, err := c.address(ctx, vmi.Status.NodeName)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, method, "https://"+addr+actionPath(vmi, action), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.client(vmi.Status.NodeName).Do(req)
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("nodeagent on %s: %w", vmi.Status.NodeName, err))
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("nodeagent on %s: %w", vmi.Status.NodeName, err))
	}
	if resp.StatusCode/100 != 2 {
		return nil, nodeError(resp.StatusCode, data)
	}
	return data, nil
}

// nodeError turns an agent's error answer into an API status error.
func nodeError(code int, body []byte) error {
	var st metav1.Status
	if json.Unmarshal(body, &st) == nil && st.Kind == "Status" && st.Message != "" {
		if st.Code == 0 {
			st.Code = int32(code)
		}
		return &apierrors.StatusError{ErrStatus: st}
	}
	msg := string(bytes.TrimSpace(body))
	if msg == "" {
		msg = http.StatusText(code)
	}
	return &apierrors.StatusError{ErrStatus: metav1.Status{Status: metav1.StatusFailure, Code: int32(code),
		Reason: metav1.StatusReasonUnknown, Message: "nodeagent: " + msg}}
}

// Stream implements NodeClient.
func (c *HTTPSNodeClient) Stream(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, action string, query url.Values) (io.ReadWriteCloser, error) {
	addr, err := c.address(ctx, vmi.Status.NodeName)
	if err != nil {
		return nil, err
	}
	u := url.URL{Scheme: "wss", Host: addr, Path: actionPath(vmi, action), RawQuery: query.Encode()}
	d := websocket.Dialer{TLSClientConfig: c.tlsFor(vmi.Status.NodeName), Subprotocols: []string{PlainStreamProtocol},
		ReadBufferSize: wsBufferSize, WriteBufferSize: wsBufferSize, HandshakeTimeout: 10 * time.Second}
	conn, resp, err := d.DialContext(ctx, u.String(), nil)
	if err != nil {
		if resp != nil {
			data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
			return nil, nodeError(resp.StatusCode, data)
		}
		return nil, apierrors.NewInternalError(fmt.Errorf("nodeagent on %s: %w", vmi.Status.NodeName, err))
	}
	return plainstream.New(conn), nil
}
