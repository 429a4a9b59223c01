package agent

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/subresources"
	"github.com/nodevirt/nodevirt/clusterbrain/upload/uploadtls"
)

// consoleTLS gives the console server a certificate from the cluster's
// node CA (a Secret in the brain's namespace, created by whichever of the
// brain and the agents comes first) when no certificate files are
// configured, and admits only the brain's subresource client.
//
// Every node can read that CA's key: a compromised node could mint a client
// certificate. Per-node certificates signed by the brain are the way out and
// are not done yet.
func consoleTLS(ctx context.Context, cfg *Config, kube kubernetes.Interface) error {
	c := &cfg.Console
	if c.Addr == "" || c.TLS != nil || c.CertFile != "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ca, err := uploadtls.EnsureCA(ctx, kube, cfg.BrainNamespace)
	if err != nil {
		return fmt.Errorf("console certificate authority: %w", err)
	}
	cert, err := ca.Issue(subresources.NodeServerName, []string{subresources.NodeServerName, cfg.NodeName}, nil, false)
	if err != nil {
		return fmt.Errorf("console certificate: %w", err)
	}
	c.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: ca.Pool(),
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}
	if len(c.AllowedClients) == 0 {
		c.AllowedClients = []string{subresources.ClientName}
	}
	return nil
}

// advertiseConsole publishes the console server's address on the Node, where
// the brain looks for it.
func advertiseConsole(ctx context.Context, cfg Config, kube kubernetes.Interface, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if ip := net.ParseIP(host); host == "" || ip == nil || ip.IsUnspecified() {
		hostIP, err := uploadtls.HostIP()
		if err != nil {
			return err
		}
		host = hostIP.String()
	}
	if _, err := strconv.Atoi(port); err != nil {
		return fmt.Errorf("console address %s: %w", addr, err)
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		subresources.NodeAddressAnnotation: net.JoinHostPort(host, port)}}})
	_, err = kube.CoreV1().Nodes().Patch(ctx, cfg.NodeName, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}
