package console

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/net/websocket"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// RawUpgrade is the Upgrade token of an unframed stream.
const RawUpgrade = "nodevirt-stream"

// PlainSubprotocol is KubeVirt's WebSocket subprotocol for console and VNC
// bytes.
const PlainSubprotocol = "plain.kubevirt.io"

type opener func(ctx context.Context, namespace, name string) (io.ReadWriteCloser, error)

// requestOpener opens a stream from the whole request (its path values).
type requestOpener func(ctx context.Context, r *http.Request) (io.ReadWriteCloser, error)

// exclusive opens one stream per VMI and kind: a new one ends the old.
func exclusive(open opener) requestOpener {
	return func(ctx context.Context, r *http.Request) (io.ReadWriteCloser, error) {
		return open(ctx, r.PathValue("namespace"), r.PathValue("name"))
	}
}

// stream serves a console, VNC or port-forward stream over a raw upgrade
// or a WebSocket. Streams of a shared kind live side by side; of any other
// kind, a new stream for the VMI ends the previous one.
func (s *Server) stream(kind string, shared bool, open requestOpener) http.Handler {
	return httperr.TextHandler(func(w http.ResponseWriter, r *http.Request) error {
		ns, name := r.PathValue("namespace"), r.PathValue("name")
		log := s.log.With("vmi", ns+"/"+name, "stream", kind)
		upgrade := strings.ToLower(r.Header.Get("Upgrade"))
		if upgrade != RawUpgrade && upgrade != "websocket" {
			return httperr.New(http.StatusUpgradeRequired, "upgrade to %s or websocket required", RawUpgrade)
		}
		// The stream must outlive the request's context.
		backend, err := open(context.WithoutCancel(r.Context()), r)
		if err != nil {
			log.Info("open stream failed", "err", err)
			return err
		}
		key := kind + "/" + ns + "/" + name
		if shared {
			key += "/" + strconv.FormatUint(s.streamID.Add(1), 10)
		}
		if upgrade == "websocket" {
			ws := websocket.Server{
				Handshake: func(c *websocket.Config, r *http.Request) error {
					if slices.Contains(c.Protocol, PlainSubprotocol) {
						c.Protocol = []string{PlainSubprotocol}
					} else {
						c.Protocol = nil
					}
					return nil
				},
				Handler: func(c *websocket.Conn) {
					c.PayloadType = websocket.BinaryFrame
					s.pipe(log, key, c, c, backend)
				},
			}
			ws.ServeHTTP(w, r)
			backend.Close()
			return nil
		}
		hj, ok := w.(http.Hijacker)
		if !ok {
			backend.Close()
			return errors.New("connection cannot be upgraded")
		}
		conn, brw, err := hj.Hijack()
		if err != nil {
			backend.Close()
			log.Warn("hijack", "err", err)
			return nil // the connection is in an unknown state: no answer
		}
		_, err = io.WriteString(conn, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: "+RawUpgrade+"\r\nConnection: Upgrade\r\n\r\n")
		if err != nil {
			conn.Close()
			backend.Close()
			return nil
		}
		s.pipe(log, key, bufferedConn{Conn: conn, r: brw.Reader}, conn, backend)
		return nil
	})
}

// pipe copies between the client and the backend until either ends, after
// ending the previous session of the same key.
func (s *Server) pipe(log interface{ Info(string, ...any) }, key string, client io.ReadWriter, clientConn io.Closer, backend io.ReadWriteCloser) {
	var once sync.Once
	closeBoth := func() error {
		once.Do(func() {
			clientConn.Close()
			backend.Close()
		})
		return nil
	}
	sess := &session{close: closeBoth}
	s.mu.Lock()
	if old, ok := s.sessions[key]; ok {
		old.Close()
	}
	s.sessions[key] = sess
	s.mu.Unlock()
	log.Info("stream opened")

	done := make(chan struct{}, 2)
	go func() { io.Copy(backend, client); done <- struct{}{} }()
	go func() { io.Copy(client, backend); done <- struct{}{} }()
	<-done
	closeBoth()
	<-done

	s.mu.Lock()
	if cur, ok := s.sessions[key]; ok && cur == sess {
		delete(s.sessions, key)
	}
	s.mu.Unlock()
	log.Info("stream closed")
}

// session is one open stream; a newer one of the same key closes it.
type session struct{ close func() error }

func (s *session) Close() error { return s.close() }

// bufferedConn reads what the HTTP server buffered before the upgrade
// first.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }
