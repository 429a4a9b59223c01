// Package launcher drives libvirt domains for nodevirt: define and start,
// graceful and forced stop, pause, reboot, reset, listing and adoption of
// existing domains, the serial console stream and the VNC socket.
//
// Domain lifecycle events from libvirt, delivered on Manager.Events, are the
// status signal; nothing here polls. Domains are persistent libvirt domains:
// they outlive the process that started them and survive a libvirtd
// restart, and a guest that powered off stays visible (shut off) until it is
// undefined.
//
// It is a library inside the node agent, not a process per VM (KubeVirt's
// virt-launcher pod): the agent's handler opens one Manager, and the node's
// metrics read domain statistics over its connections (AllDomainStats).
package launcher

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"libvirt.org/go/libvirt"
)

// DefaultURI is the libvirt connection of the node.
const DefaultURI = "qemu:///system"

// DefaultPIDDir is where libvirtd's QEMU driver writes <domain>.pid.
const DefaultPIDDir = "/run/libvirt/qemu"

// Config configures a Manager.
type Config struct {
	// URI of libvirtd; DefaultURI when empty.
	URI string
	// PIDDir holds the QEMU pid files; DefaultPIDDir when empty.
	PIDDir string
	// ShutdownRetry is how often Shutdown presses the ACPI power button
	// again while the guest has not stopped; 5s when zero.
	ShutdownRetry time.Duration
	// ReconnectInterval is the wait between attempts to reconnect to a
	// libvirtd that went away; 1s when zero.
	ReconnectInterval time.Duration
	// Connections is how many connections to libvirtd the Manager keeps
	// (8 when zero). libvirtd serves one client's calls nearly one at a time,
	// so starting many domains at once over a single connection queues them
	// (measured: 20 starts took 5x longer than over 4 connections).
	Connections int
	// Logger; slog.Default() when nil.
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if c.URI == "" {
		c.URI = DefaultURI
	}
	if c.PIDDir == "" {
		c.PIDDir = DefaultPIDDir
	}
	if c.ShutdownRetry == 0 {
		c.ShutdownRetry = 5 * time.Second
	}
	if c.ReconnectInterval == 0 {
		c.ReconnectInterval = time.Second
	}
	if c.Connections == 0 {
		c.Connections = 8
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *Config) validate() error {
	if c.ShutdownRetry < 0 || c.ReconnectInterval < 0 {
		return errors.New("launcher config: negative interval")
	}
	if c.Connections < 1 {
		return errors.New("launcher config: connections must be at least 1")
	}
	return nil
}

// ErrNotFound is wrapped by errors about a domain that does not exist.
var ErrNotFound = errors.New("domain not found")

// ErrDisconnected is returned while libvirtd cannot be reached; the Manager
// keeps reconnecting in the background.
var ErrDisconnected = errors.New("not connected to libvirtd")

// Manager is a few connections to one libvirtd with its event stream. Its methods
// are safe for concurrent use.
type Manager struct {
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	conns   []*libvirt.Connect // conns[0] carries the event registration
	cbIDs   []int              // event registrations on conns[0]
	gen     int                // connection generation; a close callback of an older one is stale
	next    int
	closed  bool
	waiters map[string]map[chan struct{}]struct{}

	queue     *eventQueue
	reconnect chan struct{}
	done      chan struct{}
	wg        sync.WaitGroup
}

var (
	eventLoopOnce sync.Once
	eventLoopErr  error
)

// startEventLoop registers libvirt's default event loop and runs it in a
// goroutine. libvirt's event loop is process-wide: it is started once and
// serves every Manager of the process.
func startEventLoop(log *slog.Logger) error {
	eventLoopOnce.Do(func() {
		if err := libvirt.EventRegisterDefaultImpl(); err != nil {
			eventLoopErr = fmt.Errorf("register libvirt event loop: %w", err)
			return
		}
		go func() {
			for {
				if err := libvirt.EventRunDefaultImpl(); err != nil {
					log.Error("libvirt event loop", "err", err)
					time.Sleep(100 * time.Millisecond)
				}
			}
		}()
	})
	return eventLoopErr
}

// Open connects to libvirtd and starts delivering lifecycle events.
func Open(cfg Config) (*Manager, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := startEventLoop(cfg.Logger); err != nil {
		return nil, err
	}
	m := &Manager{
		cfg:       cfg,
		log:       cfg.Logger.With("uri", cfg.URI),
		waiters:   map[string]map[chan struct{}]struct{}{},
		queue:     newEventQueue(),
		reconnect: make(chan struct{}, 1),
		done:      make(chan struct{}),
	}
	if err := m.connect(); err != nil {
		return nil, err
	}
	m.wg.Add(2)
	go func() { defer m.wg.Done(); m.queue.run(m.done) }()
	go func() { defer m.wg.Done(); m.reconnectLoop() }()
	return m, nil
}

// Events delivers every lifecycle event of every domain of the libvirtd, in
// order, plus EventReconnected after a lost connection was made again. The
// channel is closed by Close. Events queue up (unbounded) while nobody reads.
func (m *Manager) Events() <-chan Event { return m.queue.out }

// URI is the libvirt URI the Manager is connected to.
func (m *Manager) URI() string { return m.cfg.URI }

// Close deregisters from libvirtd and closes the connection and Events.
// Domains keep running.
func (m *Manager) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	conns, ids := m.conns, m.cbIDs
	m.conns, m.cbIDs = nil, nil
	m.mu.Unlock()
	close(m.done)
	m.wg.Wait()
	release(conns, ids...)
	return nil
}

func (m *Manager) connect() error {
	m.mu.Lock()
	gen := m.gen
	m.mu.Unlock()
	onClose := func(_ *libvirt.Connect, reason libvirt.ConnectCloseReason) { m.onClose(gen, reason) }
	var conns []*libvirt.Connect
	for range m.cfg.Connections {
		conn, err := libvirt.NewConnect(m.cfg.URI)
		if err != nil {
			release(conns)
			return fmt.Errorf("connect to %s: %w", m.cfg.URI, err)
		}
		conns = append(conns, conn)
		// Keepalive notices a libvirtd that hangs; a closed socket is
		// noticed at once by the close callback.
		if err := conn.SetKeepAlive(5, 3); err != nil {
			m.log.Debug("no keepalive", "err", err)
		}
		if err := conn.RegisterCloseCallback(onClose); err != nil {
			release(conns)
			return fmt.Errorf("register close callback on %s: %w", m.cfg.URI, err)
		}
	}
	id, err := conns[0].DomainEventLifecycleRegister(nil, m.onLifecycle)
	if err != nil {
		release(conns)
		return fmt.Errorf("register lifecycle events on %s: %w", m.cfg.URI, err)
	}
	agentID, err := conns[0].DomainEventAgentLifecycleRegister(nil, m.onAgentLifecycle)
	if err != nil {
		release(conns, id)
		return fmt.Errorf("register guest agent events on %s: %w", m.cfg.URI, err)
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		release(conns, id, agentID)
		return errors.New("launcher: closed")
	}
	m.conns, m.cbIDs = conns, []int{id, agentID}
	m.mu.Unlock()
	return nil
}

// release drops connections and their callbacks (best effort: they may be
// dead); cbIDs are the event registrations on conns[0] (negative: none).
func release(conns []*libvirt.Connect, cbIDs ...int) {
	for i, conn := range conns {
		conn.UnregisterCloseCallback()
		if i == 0 {
			for _, id := range cbIDs {
				if id >= 0 {
					conn.DomainEventDeregister(id)
				}
			}
		}
		conn.Close()
	}
}

// onClose starts a reconnect when a connection of the current generation
// closes; the other connections of that generation closing too is no news.
func (m *Manager) onClose(gen int, reason libvirt.ConnectCloseReason) {
	m.mu.Lock()
	stale := gen != m.gen
	if !stale {
		m.gen++
	}
	m.mu.Unlock()
	if stale {
		return
	}
	m.log.Warn("libvirt connection closed", "reason", int(reason))
	select {
	case m.reconnect <- struct{}{}:
	default:
	}
}

func (m *Manager) reconnectLoop() {
	for {
		select {
		case <-m.done:
			return
		case <-m.reconnect:
		}
		m.mu.Lock()
		old := m.conns
		m.conns, m.cbIDs = nil, nil
		m.mu.Unlock()
		release(old) // the event registrations died with their connection
		for {
			err := m.connect()
			if err == nil {
				break
			}
			m.log.Warn("reconnect to libvirtd", "err", err)
			select {
			case <-m.done:
				return
			case <-time.After(m.cfg.ReconnectInterval):
			}
		}
		m.log.Info("reconnected to libvirtd")
		m.queue.push(Event{Type: EventReconnected})
		m.wakeAll()
	}
}

func (m *Manager) onLifecycle(_ *libvirt.Connect, d *libvirt.Domain, ev *libvirt.DomainEventLifecycle) {
	name, err := d.GetName()
	if err != nil {
		m.log.Error("lifecycle event without a domain name", "err", err)
		return
	}
	uuid, _ := d.GetUUIDString()
	e := newEvent(name, uuid, ev)
	m.log.Debug("domain event", "domain", name, "event", e.Type.String(), "reason", e.Reason)
	m.queue.push(e)
	m.wake(name)
}

// watch returns a channel that receives a signal after each lifecycle event
// of the domain (and after a reconnect); a waiter re-reads the state.
func (m *Manager) watch(name string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	m.mu.Lock()
	if m.waiters[name] == nil {
		m.waiters[name] = map[chan struct{}]struct{}{}
	}
	m.waiters[name][ch] = struct{}{}
	m.mu.Unlock()
	return ch, func() {
		m.mu.Lock()
		delete(m.waiters[name], ch)
		if len(m.waiters[name]) == 0 {
			delete(m.waiters, name)
		}
		m.mu.Unlock()
	}
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (m *Manager) wake(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for ch := range m.waiters[name] {
		signal(ch)
	}
}

func (m *Manager) wakeAll() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ws := range m.waiters {
		for ch := range ws {
			signal(ch)
		}
	}
}

// connection returns the live connection with a reference the caller must
// Close.
func (m *Manager) connection() (*libvirt.Connect, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.conns) == 0 {
		return nil, ErrDisconnected
	}
	conn := m.conns[m.next%len(m.conns)]
	m.next++
	if err := conn.Ref(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDisconnected, err)
	}
	return conn, nil
}

// withDomain runs fn on the named domain.
func (m *Manager) withDomain(name string, fn func(*libvirt.Domain) error) error {
	conn, err := m.connection()
	if err != nil {
		return err
	}
	defer conn.Close()
	d, err := conn.LookupDomainByName(name)
	if err != nil {
		return wrapErr(name, err)
	}
	defer d.Free()
	return fn(d)
}

func libvirtCode(err error) libvirt.ErrorNumber {
	var lerr libvirt.Error
	if errors.As(err, &lerr) {
		return lerr.Code
	}
	return libvirt.ERR_OK
}

func wrapErr(name string, err error) error {
	if libvirtCode(err) == libvirt.ERR_NO_DOMAIN {
		return fmt.Errorf("domain %s: %w", name, ErrNotFound)
	}
	return fmt.Errorf("domain %s: %w", name, err)
}
