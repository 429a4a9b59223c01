package console

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/websocket"
)

// echoBackend answers streams with a line-echo service ("echo: <line>")
// over a real socket pair, and records control calls. It stands in for
// the VM side, which the handler's integration test covers with QEMU.
type echoBackend struct {
	calls chan string
}

func (b *echoBackend) open(namespace, name string) (io.ReadWriteCloser, error) {
	switch name {
	case "missing":
		return nil, fmt.Errorf("%w: %s/%s", ErrNotFound, namespace, name)
	case "stopped":
		return nil, fmt.Errorf("%w: %s/%s", ErrNotRunning, namespace, name)
	}
	a, c := net.Pipe()
	go func() {
		defer c.Close()
		sc := bufio.NewScanner(c)
		for sc.Scan() {
			if _, err := fmt.Fprintf(c, "echo: %s\n", sc.Text()); err != nil {
				return
			}
		}
	}()
	return a, nil
}

func (b *echoBackend) Console(_ context.Context, ns, name string) (io.ReadWriteCloser, error) {
	return b.open(ns, name)
}
func (b *echoBackend) VNC(_ context.Context, ns, name string) (io.ReadWriteCloser, error) {
	return b.open(ns, name)
}
func (b *echoBackend) do(action, ns, name string) error {
	if _, err := b.open(ns, name); err != nil {
		return err
	}
	b.calls <- action + " " + ns + "/" + name
	return nil
}
func (b *echoBackend) Pause(_ context.Context, ns, name string) error { return b.do("pause", ns, name) }
func (b *echoBackend) Unpause(_ context.Context, ns, name string) error {
	return b.do("unpause", ns, name)
}
func (b *echoBackend) SoftReboot(_ context.Context, ns, name string) error {
	return b.do("softreboot", ns, name)
}
func (b *echoBackend) Reset(_ context.Context, ns, name string) error { return b.do("reset", ns, name) }
func (b *echoBackend) Shutdown(_ context.Context, ns, name string) error {
	return b.do("shutdown", ns, name)
}

var _ Backend = (*echoBackend)(nil)

func startServer(t *testing.T, mutate func(*Config)) (*Server, *PKI, *echoBackend) {
	t.Helper()
	pki, err := MintPKI(t.TempDir(), "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	cfg := pki.ServerConfig("127.0.0.1:0")
	if mutate != nil {
		mutate(&cfg)
	}
	b := &echoBackend{calls: make(chan string, 10)}
	s, err := New(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	return s, pki, b
}

func client(t *testing.T, s *Server, pki *PKI) *Client {
	t.Helper()
	tc, err := pki.ClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	return &Client{Addr: s.Addr(), TLS: tc}
}

func roundTrip(t *testing.T, rw io.ReadWriter, r *bufio.Reader, line string) {
	t.Helper()
	if _, err := fmt.Fprintln(rw, line); err != nil {
		t.Fatal(err)
	}
	got, err := r.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	if want := "echo: " + line + "\n"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
}

func TestRawStreamAndTakeover(t *testing.T) {
	s, pki, _ := startServer(t, nil)
	c := client(t, s, pki)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	first, err := c.Console(ctx, "ns", "vm")
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	r1 := bufio.NewReader(first)
	roundTrip(t, first, r1, "hello")

	second, err := c.Console(ctx, "ns", "vm")
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	roundTrip(t, second, bufio.NewReader(second), "again")
	first.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r1.ReadString('\n'); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("first console still open after a second one: %v", err)
	}
	// A VNC stream of the same VMI is a different session.
	vnc, err := c.VNC(ctx, "ns", "vm")
	if err != nil {
		t.Fatal(err)
	}
	defer vnc.Close()
	roundTrip(t, vnc, bufio.NewReader(vnc), "rfb")
	roundTrip(t, second, bufio.NewReader(second), "still")
}

func TestStreamErrors(t *testing.T) {
	s, pki, _ := startServer(t, nil)
	c := client(t, s, pki)
	ctx := context.Background()
	if _, err := c.Console(ctx, "ns", "missing"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("missing vmi: %v, want 404", err)
	}
	if _, err := c.VNC(ctx, "ns", "stopped"); err == nil || !strings.Contains(err.Error(), "409") {
		t.Errorf("stopped vmi: %v, want 409", err)
	}
}

func TestWebSocketPlainSubprotocol(t *testing.T) {
	s, pki, _ := startServer(t, nil)
	tc, err := pki.ClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := websocket.NewConfig("wss://"+s.Addr()+"/v1/namespaces/ns/virtualmachineinstances/vm/console", "https://brain")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Protocol = []string{PlainSubprotocol}
	cfg.TlsConfig = tc
	ws, err := websocket.DialConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	if got := ws.Config().Protocol; len(got) != 1 || got[0] != PlainSubprotocol {
		t.Errorf("subprotocol %v, want %s", got, PlainSubprotocol)
	}
	ws.PayloadType = websocket.BinaryFrame
	ws.SetDeadline(time.Now().Add(10 * time.Second))
	roundTrip(t, ws, bufio.NewReader(ws), "over websocket")
}

func TestControls(t *testing.T) {
	s, pki, b := startServer(t, nil)
	c := client(t, s, pki)
	ctx := context.Background()
	for _, a := range []string{"pause", "unpause", "softreboot", "reset", "shutdown"} {
		if err := c.Do(ctx, "ns", "vm", a); err != nil {
			t.Fatalf("%s: %v", a, err)
		}
		if got := <-b.calls; got != a+" ns/vm" {
			t.Errorf("backend got %q for %s", got, a)
		}
	}
	if err := c.Do(ctx, "ns", "missing", "pause"); !errors.Is(err, ErrNotFound) {
		t.Errorf("pause of a missing vmi: %v", err)
	}
	if err := c.Do(ctx, "ns", "stopped", "pause"); !errors.Is(err, ErrNotRunning) {
		t.Errorf("pause of a stopped vmi: %v", err)
	}
	if err := c.Do(ctx, "ns", "vm", "explode"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("unknown action: %v", err)
	}
}

func TestMutualTLS(t *testing.T) {
	s, pki, _ := startServer(t, func(c *Config) { c.AllowedClients = []string{"someone-else"} })
	ctx := context.Background()

	// No client certificate: the handshake fails.
	tc, err := pki.ClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	anon := tc.Clone()
	anon.Certificates = nil
	if err := (&Client{Addr: s.Addr(), TLS: anon}).Do(ctx, "ns", "vm", "pause"); err == nil {
		t.Error("a client without certificate got in")
	}

	// A certificate from another CA: rejected.
	other, err := MintPKI(t.TempDir(), "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	otc, err := other.ClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	otc.RootCAs = tc.RootCAs
	if err := (&Client{Addr: s.Addr(), TLS: otc}).Do(ctx, "ns", "vm", "pause"); err == nil {
		t.Error("a client of another CA got in")
	}

	// The right CA but a name outside AllowedClients: 403.
	if err := (&Client{Addr: s.Addr(), TLS: tc}).Do(ctx, "ns", "vm", "pause"); err == nil || !strings.Contains(err.Error(), "403") {
		t.Errorf("client outside AllowedClients: %v, want 403", err)
	}
	// And the server's own certificate must verify for the client.
	bad := tc.Clone()
	bad.RootCAs = otc.RootCAs
	if _, err := (&Client{Addr: s.Addr(), TLS: bad}).Console(ctx, "ns", "vm"); err == nil {
		t.Error("client trusted a server of another CA")
	}
}

func TestAllowedClientName(t *testing.T) {
	s, pki, b := startServer(t, func(c *Config) { c.AllowedClients = []string{BrainClientName} })
	if err := client(t, s, pki).Do(context.Background(), "ns", "vm", "reset"); err != nil {
		t.Fatal(err)
	}
	<-b.calls
}
