// Package plainstream is KubeVirt's plain.kubevirt.io websocket framing: a
// byte stream (serial console, RFB) carried in binary messages. Both the
// brain's proxy and the CLI use it.
package plainstream

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/gorilla/websocket"
)

const (
	// Protocol is the websocket subprotocol.
	Protocol = "plain.kubevirt.io"
	// BufferSize is KubeVirt's websocket buffer size.
	BufferSize = 10240
)

// Dial opens a plain.kubevirt.io websocket to url (wss:// or ws://). A
// refused handshake returns the HTTP response (body unread) with the error.
func Dial(ctx context.Context, url string, tlsConfig *tls.Config, header http.Header) (*Stream, *http.Response, error) {
	d := websocket.Dialer{TLSClientConfig: tlsConfig, Subprotocols: []string{Protocol}, Proxy: http.ProxyFromEnvironment,
		ReadBufferSize: BufferSize, WriteBufferSize: BufferSize, HandshakeTimeout: 30 * time.Second}
	conn, resp, err := d.DialContext(ctx, url, header)
	if err != nil {
		return nil, resp, fmt.Errorf("websocket %s: %w", url, err)
	}
	return New(conn), resp, nil
}

// Stream is a websocket read and written as a byte stream of binary
// messages (KubeVirt's plain.kubevirt.io framing).
type Stream struct {
	conn *websocket.Conn
	r    io.Reader
	wmu  sync.Mutex
}

// NewStream wraps conn.
func New(conn *websocket.Conn) *Stream { return &Stream{conn: conn} }

// Read returns bytes of binary messages; a normal close is io.EOF.
func (b *Stream) Read(p []byte) (int, error) {
	for {
		if b.r == nil {
			typ, r, err := b.conn.NextReader()
			if err != nil {
				var ce *websocket.CloseError
				if errors.As(err, &ce) && ce.Code == websocket.CloseNormalClosure {
					return 0, io.EOF
				}
				return 0, err
			}
			if typ != websocket.BinaryMessage && typ != websocket.TextMessage {
				continue
			}
			b.r = r
		}
		n, err := b.r.Read(p)
		if err == io.EOF {
			b.r = nil
			if n == 0 {
				continue
			}
			err = nil
		}
		return n, err
	}
}

// Write sends p as one binary message.
func (b *Stream) Write(p []byte) (int, error) {
	b.wmu.Lock()
	defer b.wmu.Unlock()
	if err := b.conn.WriteMessage(websocket.BinaryMessage, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Close closes the connection.
func (b *Stream) Close() error { return b.conn.Close() }

// Conn is the websocket underneath.
func (b *Stream) Conn() *websocket.Conn { return b.conn }
