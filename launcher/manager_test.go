package launcher

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher/domain"
)

var testDomainSeq atomic.Int64

// testDomain is a domain of libvirt's test driver carrying nodevirt metadata.
func testDomain(t *testing.T) *libvirtxml.Domain {
	t.Helper()
	n := testDomainSeq.Add(1)
	md, err := domain.Metadata{UID: fmt.Sprintf("uid-%d", n), Namespace: "unit", Name: fmt.Sprintf("vm-%d", n)}.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return &libvirtxml.Domain{
		Type:     "test",
		Name:     domain.Name("unit", fmt.Sprintf("vm-%d", n)),
		Metadata: &libvirtxml.DomainMetadata{XML: md},
		Memory:   &libvirtxml.DomainMemory{Value: 64, Unit: "MiB"},
		VCPU:     &libvirtxml.DomainVCPU{Value: 1},
		OS:       &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Type: "hvm"}},
	}
}

func openTest(t *testing.T) *Manager {
	t.Helper()
	m, err := Open(Config{URI: "test:///default", ShutdownRetry: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// nextEvent returns the next event of the named domain (others are skipped).
func nextEvent(t *testing.T, m *Manager, name string) Event {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case e, ok := <-m.Events():
			if !ok {
				t.Fatal("events closed")
			}
			if e.Domain == name {
				return e
			}
		case <-timeout:
			t.Fatalf("no event for %s", name)
		}
	}
}

func expectEvent(t *testing.T, m *Manager, name string, typ EventType, reason string, state State) {
	t.Helper()
	e := nextEvent(t, m, name)
	if e.Type != typ || e.Reason != reason || e.State != state {
		t.Fatalf("event %v, want %s (%s) -> %s", e, typ, reason, state)
	}
}

func TestLifecycleEventsDriveState(t *testing.T) {
	ctx := context.Background()
	m := openTest(t)
	dom := testDomain(t)
	name := dom.Name

	if err := m.Create(ctx, dom, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	expectEvent(t, m, name, EventDefined, "added", StateShutoff)
	expectEvent(t, m, name, EventStarted, "booted", StateRunning)

	// Idempotent start.
	if err := m.Start(ctx, name, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := m.Pause(ctx, name); err != nil {
		t.Fatal(err)
	}
	expectEvent(t, m, name, EventSuspended, "paused", StatePaused)
	if err := m.Pause(ctx, name); err != nil {
		t.Fatalf("pausing a paused domain: %v", err)
	}
	if err := m.Unpause(ctx, name); err != nil {
		t.Fatal(err)
	}
	expectEvent(t, m, name, EventResumed, "unpaused", StateRunning)

	info, err := m.Lookup(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if info.State != StateRunning || !info.HasVMI || info.VMI.Namespace != "unit" || info.UUID == "" {
		t.Fatalf("lookup: %+v", info)
	}

	if err := m.Shutdown(ctx, name, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// The test driver powers off at once: no destroy was needed.
	e := nextEvent(t, m, name)
	for e.Type == EventShutdown {
		e = nextEvent(t, m, name)
	}
	if e.Type != EventStopped || e.Reason != "shutdown" {
		t.Fatalf("after shutdown: %v", e)
	}
	info, err = m.Lookup(ctx, name)
	if err != nil || info.State != StateShutoff || info.PID != 0 {
		t.Fatalf("after shutdown: %+v %v", info, err)
	}
	// Stopping what is stopped succeeds.
	if err := m.Shutdown(ctx, name, time.Second); err != nil {
		t.Fatal(err)
	}
	if err := m.Destroy(ctx, name); err != nil {
		t.Fatal(err)
	}

	// (Starting paused is checked against QEMU: the test driver lacks it.)
	if err := m.Start(ctx, name, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := m.Destroy(ctx, name); err != nil {
		t.Fatal(err)
	}
	for e := nextEvent(t, m, name); !(e.Type == EventStopped && e.Reason == "destroyed"); e = nextEvent(t, m, name) {
	}
	if err := m.Undefine(ctx, name); err != nil {
		t.Fatal(err)
	}
	expectEvent(t, m, name, EventUndefined, "removed", StateNoState)
	if _, err := m.Lookup(ctx, name); !errors.Is(err, ErrNotFound) {
		t.Fatalf("lookup after undefine: %v", err)
	}
}

func TestGoneDomains(t *testing.T) {
	ctx := context.Background()
	m := openTest(t)
	for name, err := range map[string]error{
		"undefine": m.Undefine(ctx, "nope_nope"),
		"destroy":  m.Destroy(ctx, "nope_nope"),
		"shutdown": m.Shutdown(ctx, "nope_nope", time.Second),
	} {
		if err != nil {
			t.Errorf("%s of a missing domain: %v", name, err)
		}
	}
	for name, err := range map[string]error{
		"start": m.Start(ctx, "nope_nope", StartOptions{}),
		"pause": m.Pause(ctx, "nope_nope"),
	} {
		if !errors.Is(err, ErrNotFound) {
			t.Errorf("%s of a missing domain: %v, want ErrNotFound", name, err)
		}
	}
}

func TestListAdoptsByMetadata(t *testing.T) {
	ctx := context.Background()
	m := openTest(t)
	dom := testDomain(t)
	if err := m.Create(ctx, dom, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Undefine(ctx, dom.Name) })
	all, err := m.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ours, foreign int
	for _, d := range all {
		switch {
		case d.Name == dom.Name:
			ours++
			if !d.HasVMI || d.VMI.Name+"" == "" || d.State != StateRunning {
				t.Errorf("our domain: %+v", d)
			}
		case !d.HasVMI:
			foreign++ // the test driver's own "test" domain
		}
	}
	if ours != 1 || foreign == 0 {
		t.Fatalf("ours=%d foreign=%d in %+v", ours, foreign, all)
	}
}

func TestDefineRejectsInvalid(t *testing.T) {
	m := openTest(t)
	dom := testDomain(t)
	dom.Memory = nil
	dom.Devices = &libvirtxml.DomainDeviceList{Disks: []libvirtxml.DomainDisk{{Device: "floppy-bogus"}}}
	if err := m.Define(context.Background(), dom); err == nil {
		m.Undefine(context.Background(), dom.Name)
		t.Fatal("invalid domain defined")
	}
}

func TestGracefulShutdownWithoutGraceDestroys(t *testing.T) {
	ctx := context.Background()
	m := openTest(t)
	dom := testDomain(t)
	if err := m.Create(ctx, dom, StartOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Undefine(ctx, dom.Name) })
	if err := m.Shutdown(ctx, dom.Name, 0); err != nil {
		t.Fatal(err)
	}
	info, err := m.Lookup(ctx, dom.Name)
	if err != nil || info.State != StateShutoff || info.Reason != "destroyed" {
		t.Fatalf("%+v %v", info, err)
	}
}
