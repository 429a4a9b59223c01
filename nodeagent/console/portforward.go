package console

import (
	"context"
	"io"
	"net/http"
	"strconv"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// PortForwardBackend connects to a port of a running VMI's guest; the
// virt-handler role implements it. Errors wrap ErrNotFound or ErrNotRunning
// where they apply, or carry their own status (httperr). A Backend without
// it answers port-forward requests 501.
type PortForwardBackend interface {
	// PortForward dials port (1-65535) of the guest over protocol ("tcp"
	// or "udp"); Close ends that connection only.
	PortForward(ctx context.Context, namespace, name string, port int, protocol string) (io.ReadWriteCloser, error)
}

// Protocols that can be forwarded.
const (
	ProtocolTCP = "tcp"
	ProtocolUDP = "udp"
)

// ParsePortForward checks a forwarded port and protocol as they come in a
// path (an empty protocol is tcp).
func ParsePortForward(port, protocol string) (int, string, error) {
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return 0, "", httperr.BadRequest("port %q is not a port number (1-65535)", port)
	}
	switch protocol {
	case "":
		protocol = ProtocolTCP
	case ProtocolTCP, ProtocolUDP:
	default:
		return 0, "", httperr.BadRequest("protocol %q cannot be forwarded: tcp or udp", protocol)
	}
	return p, protocol, nil
}

// portForward opens the guest connection of a port-forward request.
func (s *Server) portForward(ctx context.Context, r *http.Request) (io.ReadWriteCloser, error) {
	pf, ok := s.backend.(PortForwardBackend)
	if !ok {
		return nil, httperr.NotImplemented("port forwarding is not served by this node")
	}
	port, protocol, err := ParsePortForward(r.PathValue("port"), r.PathValue("protocol"))
	if err != nil {
		return nil, err
	}
	return pf.PortForward(ctx, r.PathValue("namespace"), r.PathValue("name"), port, protocol)
}

// ScreenshotBackend takes pictures of a running VMI's display; the
// virt-handler role implements it. A Backend without it answers screenshot
// requests 501.
type ScreenshotBackend interface {
	// Screenshot returns the first display as PNG.
	Screenshot(ctx context.Context, namespace, name string) ([]byte, error)
}

// screenshot answers a screenshot request with the PNG.
func (s *Server) screenshot(w http.ResponseWriter, r *http.Request) error {
	sb, ok := s.backend.(ScreenshotBackend)
	if !ok {
		return httperr.NotImplemented("screenshots are not served by this node")
	}
	img, err := sb.Screenshot(r.Context(), r.PathValue("namespace"), r.PathValue("name"))
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "image/png")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(img)
	return nil
}
