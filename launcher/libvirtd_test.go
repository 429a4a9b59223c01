package launcher

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
)

// TestGoldenDomainsValidateInLibvirt defines every golden domain in the real
// libvirtd with schema and capability validation, then undefines it.
func TestGoldenDomainsValidateInLibvirt(t *testing.T) {
	ctx := context.Background()
	m, err := Open(Config{URI: libvirttest.Ensure(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	goldens, _ := filepath.Glob("domain/testdata/*.xml")
	if len(goldens) == 0 {
		t.Fatal("no golden domains")
	}
	for _, g := range goldens {
		t.Run(filepath.Base(g), func(t *testing.T) {
			b, err := os.ReadFile(g)
			if err != nil {
				t.Fatal(err)
			}
			var dom libvirtxml.Domain
			if err := dom.Unmarshal(string(b)); err != nil {
				t.Fatal(err)
			}
			dom.Name = "golden-" + strings.TrimSuffix(filepath.Base(g), ".xml")
			dom.UUID = ""
			err = m.Define(ctx, &dom)
			if err != nil && dom.Type == "kvm" && strings.Contains(err.Error(), "does not support virt type 'kvm'") {
				// The host's libvirt found no usable KVM (its probe can
				// fail on a loaded machine): the rest of the XML is what
				// is checked here.
				t.Logf("no KVM in this libvirt, defining %s as type qemu", dom.Name)
				dom.Type = "qemu"
				err = m.Define(ctx, &dom)
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := m.Undefine(ctx, dom.Name); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// unixProxy forwards connections to a unix socket and can drop them all,
// which to a libvirt client looks like libvirtd going away.
type unixProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  []net.Conn
}

func newUnixProxy(t *testing.T, target string) *unixProxy {
	path := filepath.Join(t.TempDir(), "libvirt.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	p := &unixProxy{ln: ln, target: target}
	t.Cleanup(func() { ln.Close(); p.dropAll() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("unix", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			go func() { io.Copy(up, c); up.Close() }()
			go func() { io.Copy(c, up); c.Close() }()
		}
	}()
	return p
}

func (p *unixProxy) dropAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// TestReconnectsWhenLibvirtdGoesAway cuts the connection under the Manager
// (as a libvirtd restart does) and expects the close callback to bring it
// back, announced by EventReconnected, with events flowing again.
func TestReconnectsWhenLibvirtdGoesAway(t *testing.T) {
	libvirttest.Ensure(t)
	proxy := newUnixProxy(t, "/run/libvirt/libvirt-sock")
	m, err := Open(Config{URI: "qemu+unix:///system?socket=" + proxy.ln.Addr().String(), ReconnectInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ctx := context.Background()
	if _, err := m.List(ctx); err != nil {
		t.Fatal(err)
	}
	proxy.dropAll()
	deadline := time.After(30 * time.Second)
	for reconnected := false; !reconnected; {
		select {
		case e := <-m.Events():
			reconnected = e.Type == EventReconnected
		case <-deadline:
			t.Fatal("no reconnect after the connection dropped")
		}
	}
	if _, err := m.List(ctx); err != nil {
		t.Fatalf("list after reconnect: %v", err)
	}
	// Events arrive on the new connection.
	dom := &libvirtxml.Domain{
		Type: "qemu", Name: "reconnect-probe",
		Memory: &libvirtxml.DomainMemory{Value: 32, Unit: "MiB"},
		OS:     &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Arch: "x86_64", Machine: "q35", Type: "hvm"}},
	}
	md, _ := domain.Metadata{UID: "probe"}.Marshal()
	dom.Metadata = &libvirtxml.DomainMetadata{XML: md}
	if err := m.Define(ctx, dom); err != nil {
		t.Fatal(err)
	}
	defer m.Undefine(ctx, dom.Name)
	waitEvent(t, m, dom.Name, EventDefined, "added", 10*time.Second)
}

// TestShutdownDestroysAfterGrace runs a VM whose firmware finds nothing to
// boot and so ignores the ACPI power button: Shutdown presses it, waits out
// the grace period and destroys the domain.
func TestShutdownDestroysAfterGrace(t *testing.T) {
	ctx := context.Background()
	m, err := Open(Config{URI: libvirttest.Ensure(t), ShutdownRetry: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() }) // after the cleanups registered below
	vmi := bootVMI(fmt.Sprintf("grace-%d", os.Getpid()))
	vmi.Spec.StartStrategy = nil
	vmi.Spec.Domain.Devices.Interfaces = nil
	vmi.Spec.Networks = nil
	vmi.Spec.Domain.Devices.Disks = vmi.Spec.Domain.Devices.Disks[1:2] // the blank disk only
	vmi.Spec.Volumes = vmi.Spec.Volumes[1:2]
	env := domain.Env{Emulation: true, StateDir: libvirttest.StateDir(t)}
	dom, err := domain.Convert(vmi, env)
	if err != nil {
		t.Fatal(err)
	}
	if err := domain.Prepare(ctx, vmi, env); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Undefine(context.Background(), dom.Name) })
	if err := m.Create(ctx, dom, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, m, dom.Name, EventStarted, "booted", 30*time.Second)
	const grace = 3 * time.Second
	start := time.Now()
	if err := m.Shutdown(ctx, dom.Name, grace); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	if took < grace || took > grace+20*time.Second {
		t.Errorf("shutdown took %s with a grace period of %s", took, grace)
	}
	waitEvent(t, m, dom.Name, EventStopped, "destroyed", 10*time.Second)
}
