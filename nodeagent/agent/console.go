package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os/user"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/nodeagent/handler"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
	"github.com/nodevirt/nodevirt/nodeagent/nodecert"
)

// nodeCertificate gets the node's own certificate, requested from the
// brain's signer by CSR (nodeagent/nodecert), for the endpoints that need
// one: the console server when no certificate files or TLS are configured
// (it then admits only the brain's subresource client), and the upload
// endpoint, and live migrations over TLS (then also the role that keeps
// libvirt's TLS configuration, package libvirttls). It returns nil when
// none needs it.
func nodeCertificate(cfg *Config, kc kube.Interface) (*nodecert.Source, *libvirttls.Configurer, error) {
	c := &cfg.Console
	console := c.Addr != "" && c.TLS == nil && c.CertFile == ""
	migration := cfg.MigrationTransport == "" || cfg.MigrationTransport == handler.TransportTLS
	if !console && cfg.UploadAddr == "" && !migration {
		return nil, nil, nil
	}
	ncfg := nodecert.Config{Kube: kc, NodeName: cfg.NodeName, Dir: cfg.CertDir, Duration: cfg.CertDuration, Log: cfg.Log}
	var libvirtTLS *libvirttls.Configurer
	if migration {
		// The source's libvirtd (and QEMU) check the target's certificate
		// against the address it migrates to (the InternalIP).
		ncfg.LibvirtDir, ncfg.QEMUDir = cfg.LibvirtPKIDir, cfg.QEMUTLSDir
		if ip := net.ParseIP(cfg.NodeIP); ip != nil {
			ncfg.IPs = []net.IP{ip}
		}
		gid, err := groupID(cfg.QEMUGroup)
		if err != nil {
			return nil, nil, fmt.Errorf("qemu group: %w", err)
		}
		ncfg.QEMUGid = gid
		libvirtTLS = libvirttls.New(libvirttls.Config{ConfDir: cfg.LibvirtConfDir, PKIDir: cfg.LibvirtPKIDir,
			QEMUDir: cfg.QEMUTLSDir, AdminURI: cfg.LibvirtAdminURI, Restart: cfg.LibvirtRestart, Log: cfg.Log})
		ncfg.OnWritten = libvirtTLS.Written
	}
	src, err := nodecert.New(ncfg)
	if err != nil {
		return nil, nil, fmt.Errorf("node certificate: %w", err)
	}
	if console {
		c.TLS = src.ServerTLS()
		if len(c.AllowedClients) == 0 {
			c.AllowedClients = []string{identity.SubresourcesClientName}
		}
	}
	return src, libvirtTLS, nil
}

// groupID is the gid of group, a name or a number.
func groupID(group string) (int, error) {
	if gid, err := strconv.Atoi(group); err == nil {
		return gid, nil
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(g.Gid)
}

// advertiseConsole publishes the console server's address on the Node, where
// the brain looks for it.
func advertiseConsole(ctx context.Context, cfg Config, kc kube.Interface, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if ip := net.ParseIP(host); host == "" || ip == nil || ip.IsUnspecified() {
		host = cfg.NodeIP
	}
	if _, err := strconv.Atoi(port); err != nil {
		return fmt.Errorf("console address %s: %w", addr, err)
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		identity.NodeAddressAnnotation: net.JoinHostPort(host, port)}}})
	_, err = kc.CoreV1().Nodes().Patch(ctx, cfg.NodeName, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}
