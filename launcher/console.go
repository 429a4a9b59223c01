package launcher

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"libvirt.org/go/libvirt"
)

// Console opens the domain's serial console (virDomainOpenConsole) as a byte
// stream. It takes the console over from any earlier session. Close ends the
// session; the guest keeps running.
func (m *Manager) Console(ctx context.Context, name string) (io.ReadWriteCloser, error) {
	st, err := m.openStream(name, "console", func(d *libvirt.Domain, st *libvirt.Stream) error {
		return d.OpenConsole("", st, libvirt.DOMAIN_CONSOLE_FORCE)
	})
	if err != nil {
		return nil, err
	}
	return &console{st: st}, nil
}

// openStream makes a libvirt stream and has open tie it to the domain
// name; the caller frees the stream.
func (m *Manager) openStream(name, what string, open func(*libvirt.Domain, *libvirt.Stream) error) (*libvirt.Stream, error) {
	conn, err := m.connection()
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", what, name, err)
	}
	defer conn.Close()
	d, err := conn.LookupDomainByName(name)
	if err != nil {
		return nil, wrapErr(name, err)
	}
	defer d.Free()
	st, err := conn.NewStream(0)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", what, name, err)
	}
	if err := open(d, st); err != nil {
		st.Free()
		return nil, fmt.Errorf("%s %s: %w", what, name, err)
	}
	return st, nil
}

// rawStream is what a console needs of a libvirt stream (*libvirt.Stream).
type rawStream interface {
	Recv(p []byte) (int, error)
	Send(p []byte) (int, error)
	Abort() error
	Free() error
}

var _ rawStream = (*libvirt.Stream)(nil)

// console is a libvirt console stream shared by a reader and a writer.
// Close may come while the reader is blocked inside Recv (the client went
// away): it aborts the stream at once, which ends that Recv, but frees it
// only once no Recv or Send is in flight — freeing under a running Recv
// is a use after free in libvirt.
type console struct {
	st      rawStream
	writeMu sync.Mutex

	mu     sync.Mutex
	users  int // Recv and Send calls in flight
	closed bool
	once   sync.Once
	free   sync.Once
}

// errConsoleClosed answers a Read or Write after Close.
var errConsoleClosed = errors.New("console closed")

// enter registers a stream call; false after Close.
func (c *console) enter() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.users++
	return true
}

// leave ends a stream call, freeing the stream if it was the last one after
// Close.
func (c *console) leave() {
	c.mu.Lock()
	c.users--
	last := c.closed && c.users == 0
	c.mu.Unlock()
	if last {
		c.release()
	}
}

func (c *console) release() { c.free.Do(func() { _ = c.st.Free() }) }

func (c *console) Read(p []byte) (int, error) {
	if !c.enter() {
		return 0, errConsoleClosed
	}
	defer c.leave()
	n, err := c.st.Recv(p)
	if err != nil && err != io.EOF {
		return n, fmt.Errorf("console read: %w", err)
	}
	return n, err
}

func (c *console) Write(p []byte) (int, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if !c.enter() {
		return 0, errConsoleClosed
	}
	defer c.leave()
	written := 0
	for written < len(p) {
		n, err := c.st.Send(p[written:])
		if err != nil {
			return written, fmt.Errorf("console write: %w", err)
		}
		written += n
	}
	return written, nil
}

// Close aborts the stream; it is freed now if no call is in flight, else
// when the last one returns.
func (c *console) Close() error {
	c.once.Do(func() {
		c.mu.Lock()
		c.closed = true
		idle := c.users == 0
		c.mu.Unlock()
		_ = c.st.Abort()
		if idle {
			c.release()
		}
	})
	return nil
}

// VNCSocket returns the unix socket QEMU serves the domain's VNC display on.
func (m *Manager) VNCSocket(ctx context.Context, name string) (string, error) {
	dom, err := m.DomainXML(ctx, name)
	if err != nil {
		return "", err
	}
	if dom.Devices != nil {
		for _, g := range dom.Devices.Graphics {
			if g.VNC == nil {
				continue
			}
			if g.VNC.Socket != "" {
				return g.VNC.Socket, nil
			}
			for _, l := range g.VNC.Listeners {
				if l.Socket != nil && l.Socket.Socket != "" {
					return l.Socket.Socket, nil
				}
			}
		}
	}
	return "", fmt.Errorf("domain %s: no VNC unix socket (inactive, or no VNC graphics)", name)
}
