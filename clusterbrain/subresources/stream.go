package subresources

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/gorilla/websocket"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/plainstream"
)

const (
	handshakeTimeout = 10 * time.Second
	replaceTimeout   = 5 * time.Second
)

func validateConsole(vmi *kubevirtv1.VirtualMachineInstance) error {
	if a := vmi.Spec.Domain.Devices.AutoattachSerialConsole; a != nil && !*a {
		return apierrors.NewBadRequest("No serial consoles are present.")
	}
	if vmi.Status.Phase == kubevirtv1.Failed {
		return apierrors.NewConflict(vmiResource, vmi.Name, errors.New("VMI is in failed status"))
	}
	if !vmi.IsRunning() {
		return apierrors.NewBadRequest(msgVMINotRunning)
	}
	return nil
}

func validateVNC(vmi *kubevirtv1.VirtualMachineInstance) error {
	if a := vmi.Spec.Domain.Devices.AutoattachGraphicsDevice; a != nil && !*a {
		return apierrors.NewBadRequest("No graphics devices are present.")
	}
	if !vmi.IsRunning() {
		return apierrors.NewBadRequest(msgVMINotRunning)
	}
	return nil
}

// screenshot answers a PNG picture of the VMI's display, taken by its
// nodeagent.
func (s *Server) screenshot(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	vmi, err := s.fetchVMI(r.Context(), req.namespace, req.name)
	if err == nil {
		err = validateVNC(vmi)
	}
	if err != nil {
		return err
	}
	img, err := s.cfg.Node.Call(r.Context(), vmi, http.MethodGet, "vnc/screenshot", nil)
	if err != nil {
		log.Info("nodeagent screenshot", "node", vmi.Status.NodeName, "err", err)
		return err
	}
	w.Header().Set("Content-Type", "image/png")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(img)
	return nil
}

// stream proxies a console or VNC websocket to the VMI's nodeagent. A new
// stream of the same kind to the same VMI ends the previous one first.
func (s *Server) stream(action string) handler {
	validate := validateConsole
	if action == "vnc" {
		validate = validateVNC
	}
	return func(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
		ctx := r.Context()
		vmi, err := s.fetchVMI(ctx, req.namespace, req.name)
		if err == nil {
			err = validate(vmi)
		}
		if err != nil {
			return err
		}
		key := action + "/" + req.namespace + "/" + req.name
		s.sessions.replace(key)
		node, err := s.cfg.Node.Stream(ctx, vmi, action, r.URL.Query())
		if err != nil {
			log.Error("open node stream", "node", vmi.Status.NodeName, "err", err)
			return err
		}
		client := upgrade(w, r, node, log)
		if client == nil {
			return nil
		}
		sess := s.sessions.add(key, func() { client.Close(); node.Close() })
		defer s.sessions.remove(key, sess)
		log.Info("stream opened", "kind", action, "node", vmi.Status.NodeName)
		n1, n2, err := splice(client, node)
		log.Info("stream closed", "kind", action, "toNode", n1, "toClient", n2, "err", err)
		return nil
	}
}

// upgrade turns the client's request into a plain.kubevirt.io websocket
// for node's stream; on failure the upgrader has answered the client, node
// is closed and the result is nil.
func upgrade(w http.ResponseWriter, r *http.Request, node io.Closer, log *slog.Logger) *plainstream.Stream {
	up := websocket.Upgrader{ReadBufferSize: wsBufferSize, WriteBufferSize: wsBufferSize,
		HandshakeTimeout: handshakeTimeout, Subprotocols: []string{PlainStreamProtocol},
		CheckOrigin: func(*http.Request) bool { return true }}
	conn, err := up.Upgrade(w, r, nil)
	if err != nil {
		node.Close()
		log.Info("websocket upgrade", "err", err)
		return nil
	}
	return plainstream.New(conn)
}

// splice copies both ways until either side ends, then closes both.
func splice(client, node io.ReadWriteCloser) (toNode, toClient int64, err error) {
	type result struct {
		n   int64
		err error
		up  bool
	}
	done := make(chan result, 2)
	go func() { n, err := io.Copy(node, client); done <- result{n, err, true} }()
	go func() { n, err := io.Copy(client, node); done <- result{n, err, false} }()
	first := <-done
	client.Close()
	node.Close()
	second := <-done
	for _, r := range []result{first, second} {
		if r.up {
			toNode = r.n
		} else {
			toClient = r.n
		}
	}
	if first.err != nil && !errors.Is(first.err, io.EOF) {
		err = fmt.Errorf("stream: %w", first.err)
	}
	return toNode, toClient, err
}

// replace ends the session under key, if any, and waits until it is gone
// (a serial port takes one reader at a time).
func (ss *sessions) replace(key string) {
	ss.mu.Lock()
	old := ss.active[key]
	ss.mu.Unlock()
	if old == nil {
		return
	}
	old.close()
	select {
	case <-old.done:
	case <-time.After(replaceTimeout):
	}
}

func (ss *sessions) add(key string, closeFn func()) *session {
	s := &session{close: closeFn, done: make(chan struct{})}
	ss.mu.Lock()
	prev := ss.active[key]
	ss.active[key] = s
	ss.mu.Unlock()
	if prev != nil { // raced with another new session: the newest wins
		prev.close()
	}
	return s
}

func (ss *sessions) remove(key string, s *session) {
	ss.mu.Lock()
	if ss.active[key] == s {
		delete(ss.active, key)
	}
	ss.mu.Unlock()
	close(s.done)
}
