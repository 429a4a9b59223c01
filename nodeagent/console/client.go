package console

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Client calls a node's console server: the brain's side of the protocol.
type Client struct {
	// Addr is the server's host:port.
	Addr string
	// TLS carries the client certificate and the CA that signed the
	// server's certificate.
	TLS *tls.Config
}

func (c *Client) path(namespace, name, what string) string {
	return "/v1/namespaces/" + url.PathEscape(namespace) + "/virtualmachineinstances/" + url.PathEscape(name) + "/" + what
}

// Console opens the VMI's serial console as a raw stream.
func (c *Client) Console(ctx context.Context, namespace, name string) (net.Conn, error) {
	return c.dial(ctx, c.path(namespace, name, "console"))
}

// VNC opens the VMI's VNC display as a raw stream.
func (c *Client) VNC(ctx context.Context, namespace, name string) (net.Conn, error) {
	return c.dial(ctx, c.path(namespace, name, "vnc"))
}

// PortForward opens a raw stream to port of the VMI's guest over protocol
// (tcp or udp).
func (c *Client) PortForward(ctx context.Context, namespace, name string, port int, protocol string) (net.Conn, error) {
	return c.dial(ctx, c.path(namespace, name, "portforward/"+strconv.Itoa(port)+"/"+protocol))
}

func (c *Client) dial(ctx context.Context, path string) (net.Conn, error) {
	d := tls.Dialer{Config: c.TLS}
	conn, err := d.DialContext(ctx, "tcp", c.Addr)
	if err != nil {
		return nil, fmt.Errorf("console %s: %w", path, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	req := "GET " + path + " HTTP/1.1\r\nHost: " + c.Addr + "\r\nConnection: Upgrade\r\nUpgrade: " + RawUpgrade + "\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		conn.Close()
		return nil, fmt.Errorf("console %s: %w", path, err)
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("console %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		conn.Close()
		return nil, fmt.Errorf("console %s: %s: %s", path, resp.Status, strings.TrimSpace(string(body)))
	}
	conn.SetDeadline(time.Time{})
	return bufferedConn{Conn: conn, r: br}, nil
}

// Do runs a control action (pause, unpause, softreboot, reset, shutdown).
func (c *Client) Do(ctx context.Context, namespace, name, action string) error {
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: c.TLS}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, "https://"+c.Addr+c.path(namespace, name, action), nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("%s %s/%s: %w", action, namespace, name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 == 2 {
		return nil
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	err = fmt.Errorf("%s %s/%s: %s: %s", action, namespace, name, resp.Status, strings.TrimSpace(string(body)))
	switch resp.StatusCode {
	case http.StatusNotFound:
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	case http.StatusConflict:
		return fmt.Errorf("%w: %w", ErrNotRunning, err)
	}
	return err
}

// GuestAgent reads guest agent information (guestosinfo, userlist,
// filesystemlist) into out, a pointer to the matching KubeVirt type.
func (c *Client) GuestAgent(ctx context.Context, namespace, name, what string, out any) error {
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: c.TLS}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+c.Addr+c.path(namespace, name, what), nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("%s %s/%s: %w", what, namespace, name, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return fmt.Errorf("%s %s/%s: %w", what, namespace, name, err)
	}
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(body, out); err != nil {
			return fmt.Errorf("%s %s/%s: %w", what, namespace, name, err)
		}
		return nil
	}
	err = fmt.Errorf("%s %s/%s: %s: %s", what, namespace, name, resp.Status, strings.TrimSpace(string(body)))
	switch resp.StatusCode {
	case http.StatusNotFound:
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	case http.StatusConflict:
		if strings.Contains(string(body), ErrNoGuestAgent.Error()) {
			return fmt.Errorf("%w: %w", ErrNoGuestAgent, err)
		}
		return fmt.Errorf("%w: %w", ErrNotRunning, err)
	}
	return err
}

// Screenshot fetches a PNG picture of the VMI's display.
func (c *Client) Screenshot(ctx context.Context, namespace, name string) ([]byte, error) {
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: c.TLS}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+c.Addr+c.path(namespace, name, "vnc/screenshot"), nil)
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("screenshot %s/%s: %w", namespace, name, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("screenshot %s/%s: %w", namespace, name, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("screenshot %s/%s: %s: %s", namespace, name, resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
}
