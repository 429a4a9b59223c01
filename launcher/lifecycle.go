package launcher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher/domain"
)

// StartOptions tune Start.
type StartOptions struct {
	// Paused starts the domain with its vCPUs paused
	// (spec.startStrategy: Paused).
	Paused bool
}

// Define stores dom as a persistent domain (libvirt validates it against its
// schema and the hypervisor's capabilities). Defining an existing domain
// replaces its definition; a running domain picks the new one up at its next
// start.
func (m *Manager) Define(ctx context.Context, dom *libvirtxml.Domain) error {
	return m.define(dom, func(*libvirt.Domain) error { return nil })
}

// define defines dom and runs then on it, over the same connection.
func (m *Manager) define(dom *libvirtxml.Domain, then func(*libvirt.Domain) error) error {
	doc, err := dom.Marshal()
	if err != nil {
		return fmt.Errorf("define %s: %w", dom.Name, err)
	}
	conn, err := m.connection()
	if err != nil {
		return fmt.Errorf("define %s: %w", dom.Name, err)
	}
	defer conn.Close()
	d, err := conn.DomainDefineXMLFlags(doc, libvirt.DOMAIN_DEFINE_VALIDATE)
	if err != nil {
		return fmt.Errorf("define %s: %w", dom.Name, err)
	}
	defer d.Free()
	return then(d)
}

// Start starts a defined domain. Starting an active domain succeeds.
func (m *Manager) Start(ctx context.Context, name string, opts StartOptions) error {
	return m.withDomain(name, func(d *libvirt.Domain) error { return start(d, name, opts, nil) })
}

// Create defines dom and starts it.
func (m *Manager) Create(ctx context.Context, dom *libvirtxml.Domain, opts StartOptions) error {
	md, _, err := domain.MetadataOf(dom)
	if err != nil {
		return fmt.Errorf("create %s: %w", dom.Name, err)
	}
	return m.define(dom, func(d *libvirt.Domain) error { return start(d, dom.Name, opts, &md) })
}

// start starts d unless it is active; md is its nodevirt metadata when the
// caller has it at hand (else it is read from the domain).
func start(d *libvirt.Domain, name string, opts StartOptions, md *domain.Metadata) error {
	state, _, err := d.GetState()
	if err != nil {
		return wrapErr(name, err)
	}
	if State(state).Active() {
		return nil
	}
	flags := libvirt.DOMAIN_NONE
	if opts.Paused {
		flags = libvirt.DOMAIN_START_PAUSED
	}
	if err := d.CreateWithFlags(flags); err != nil {
		if libvirtCode(err) == libvirt.ERR_OPERATION_INVALID {
			// Raced with another start: fine if it is up now.
			if s, _, serr := d.GetState(); serr == nil && State(s).Active() {
				return nil
			}
		}
		return fmt.Errorf("start %s: %w", name, err)
	}
	if err := applyMemoryLimit(d, md); err != nil {
		d.DestroyFlags(libvirt.DOMAIN_DESTROY_DEFAULT)
		return fmt.Errorf("start %s: %w", name, err)
	}
	return nil
}

// applyMemoryLimit sets the memory hard limit from nodevirt's metadata on
// the running domain's cgroup (see domain.Metadata.MemoryHardLimitKiB). md
// is read from the domain when nil.
func applyMemoryLimit(d *libvirt.Domain, md *domain.Metadata) error {
	if md == nil {
		doc, err := d.GetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, domain.MetadataNamespace, libvirt.DOMAIN_AFFECT_LIVE)
		if libvirtCode(err) == libvirt.ERR_NO_DOMAIN_METADATA {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read metadata: %w", err)
		}
		parsed, _, err := domain.ParseMetadata(doc)
		if err != nil {
			return err
		}
		md = &parsed
	}
	if md.MemoryHardLimitKiB == 0 {
		return nil
	}
	params := &libvirt.DomainMemoryParameters{HardLimitSet: true, HardLimit: md.MemoryHardLimitKiB}
	if err := d.SetMemoryParameters(params, libvirt.DOMAIN_AFFECT_LIVE); err != nil {
		return fmt.Errorf("set memory hard limit %d KiB: %w", md.MemoryHardLimitKiB, err)
	}
	return nil
}

// Shutdown stops a domain gracefully: it presses the ACPI power button, again
// every ShutdownRetry while the guest runs, and destroys the domain when
// grace has passed (at once when grace is 0). A paused guest cannot see the
// button, so it is resumed first. Shutdown returns when the domain is no
// longer active, as told by its lifecycle events. A domain already stopped
// or gone is success.
func (m *Manager) Shutdown(ctx context.Context, name string, grace time.Duration) error {
	if grace <= 0 {
		return m.Destroy(ctx, name)
	}
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	events, unwatch := m.watch(name)
	defer unwatch()
	for {
		var state State
		err := m.withDomain(name, func(d *libvirt.Domain) error {
			s, _, err := d.GetState()
			if err != nil {
				return wrapErr(name, err)
			}
			state = State(s)
			switch state {
			case StatePaused:
				if err := d.Resume(); err != nil {
					return fmt.Errorf("resume %s before shutdown: %w", name, err)
				}
				fallthrough
			case StateRunning, StateBlocked, StateShuttingDown:
				if err := acpiShutdown(d); err != nil && libvirtCode(err) != libvirt.ERR_OPERATION_INVALID {
					return fmt.Errorf("acpi shutdown %s: %w", name, err)
				}
			}
			return nil
		})
		if errors.Is(err, ErrNotFound) || (err == nil && !state.Active()) {
			return nil
		}
		if err != nil && !errors.Is(err, ErrDisconnected) {
			return err
		}
		retry := time.NewTimer(m.cfg.ShutdownRetry)
	wait:
		for {
			select {
			case <-ctx.Done():
				retry.Stop()
				return ctx.Err()
			case <-deadline.C:
				retry.Stop()
				m.log.Info("grace period over, destroying", "domain", name, "grace", grace)
				return m.Destroy(ctx, name)
			case <-retry.C:
				break wait
			case <-events:
				if m.isActive(name) {
					continue
				}
				retry.Stop()
				return nil
			}
		}
	}
}

// acpiShutdown presses the power button; drivers without the ACPI mode
// (libvirt's test driver) get their default shutdown.
func acpiShutdown(d *libvirt.Domain) error {
	err := d.ShutdownFlags(libvirt.DOMAIN_SHUTDOWN_ACPI_POWER_BTN)
	if c := libvirtCode(err); c == libvirt.ERR_INVALID_ARG || c == libvirt.ERR_NO_SUPPORT {
		return d.ShutdownFlags(libvirt.DOMAIN_SHUTDOWN_DEFAULT)
	}
	return err
}

func (m *Manager) isActive(name string) bool {
	active := false
	m.withDomain(name, func(d *libvirt.Domain) error {
		s, _, err := d.GetState()
		active = err == nil && State(s).Active()
		return nil
	})
	return active
}

// Destroy stops a domain at once (QEMU gets SIGTERM, then SIGKILL). An
// inactive or missing domain is success.
func (m *Manager) Destroy(ctx context.Context, name string) error {
	err := m.withDomain(name, func(d *libvirt.Domain) error {
		if err := d.DestroyFlags(libvirt.DOMAIN_DESTROY_DEFAULT); err != nil {
			if libvirtCode(err) == libvirt.ERR_OPERATION_INVALID {
				return nil // not running
			}
			return fmt.Errorf("destroy %s: %w", name, err)
		}
		return nil
	})
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}

// Pause pauses the domain's vCPUs. Pausing a paused domain succeeds.
func (m *Manager) Pause(ctx context.Context, name string) error {
	return m.withDomain(name, func(d *libvirt.Domain) error {
		if s, _, err := d.GetState(); err == nil && State(s) == StatePaused {
			return nil
		}
		if err := d.Suspend(); err != nil {
			return fmt.Errorf("pause %s: %w", name, err)
		}
		return nil
	})
}

// Unpause resumes a paused domain. Unpausing a running domain succeeds.
func (m *Manager) Unpause(ctx context.Context, name string) error {
	return m.withDomain(name, func(d *libvirt.Domain) error {
		if s, _, err := d.GetState(); err == nil && State(s) != StatePaused {
			return nil
		}
		if err := d.Resume(); err != nil {
			return fmt.Errorf("unpause %s: %w", name, err)
		}
		return nil
	})
}

// Reboot asks the guest to reboot (ACPI power button with reboot intent).
func (m *Manager) Reboot(ctx context.Context, name string) error {
	return m.withDomain(name, func(d *libvirt.Domain) error {
		if err := d.Reboot(libvirt.DOMAIN_REBOOT_ACPI_POWER_BTN); err != nil {
			return fmt.Errorf("reboot %s: %w", name, err)
		}
		return nil
	})
}

// Reset resets the virtual machine like a reset button, without the guest's
// cooperation.
func (m *Manager) Reset(ctx context.Context, name string) error {
	return m.withDomain(name, func(d *libvirt.Domain) error {
		if err := d.Reset(0); err != nil {
			return fmt.Errorf("reset %s: %w", name, err)
		}
		return nil
	})
}

// Undefine removes the domain's definition (and its NVRAM). An active
// domain is destroyed first. Undefining a missing domain succeeds.
func (m *Manager) Undefine(ctx context.Context, name string) error {
	if err := m.Destroy(ctx, name); err != nil {
		return err
	}
	err := m.withDomain(name, func(d *libvirt.Domain) error {
		flags := libvirt.DOMAIN_UNDEFINE_NVRAM | libvirt.DOMAIN_UNDEFINE_MANAGED_SAVE |
			libvirt.DOMAIN_UNDEFINE_SNAPSHOTS_METADATA | libvirt.DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
		err := d.UndefineFlags(flags)
		if libvirtCode(err) == libvirt.ERR_INVALID_ARG {
			// A driver without NVRAM or checkpoints (the test driver).
			err = d.UndefineFlags(libvirt.DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)
		}
		if err != nil {
			return fmt.Errorf("undefine %s: %w", name, err)
		}
		return nil
	})
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}
