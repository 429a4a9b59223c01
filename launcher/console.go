package launcher

import (
	"context"
	"fmt"
	"io"
	"sync"

	"libvirt.org/go/libvirt"
)

// Console opens the domain's serial console (virDomainOpenConsole) as a byte
// stream. It takes the console over from any earlier session. Close ends the
// session; the guest keeps running.
func (m *Manager) Console(ctx context.Context, name string) (io.ReadWriteCloser, error) {
	conn, err := m.connection()
	if err != nil {
		return nil, fmt.Errorf("console %s: %w", name, err)
	}
	defer conn.Close()
	d, err := conn.LookupDomainByName(name)
	if err != nil {
		return nil, wrapErr(name, err)
	}
	defer d.Free()
	st, err := conn.NewStream(0)
	if err != nil {
		return nil, fmt.Errorf("console %s: %w", name, err)
	}
	if err := d.OpenConsole("", st, libvirt.DOMAIN_CONSOLE_FORCE); err != nil {
		st.Free()
		return nil, fmt.Errorf("console %s: %w", name, err)
	}
	return &console{st: st}, nil
}

type console struct {
	st      *libvirt.Stream
	writeMu sync.Mutex
	once    sync.Once
	err     error
}

func (c *console) Read(p []byte) (int, error) {
	n, err := c.st.Recv(p)
	if err != nil && err != io.EOF {
		return n, fmt.Errorf("console read: %w", err)
	}
	return n, err
}

func (c *console) Write(p []byte) (int, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
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

func (c *console) Close() error {
	c.once.Do(func() {
		c.st.Abort()
		c.err = c.st.Free()
	})
	return c.err
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
