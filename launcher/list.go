package launcher

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher/domain"
)

// DomainInfo describes an existing domain.
type DomainInfo struct {
	Name   string
	UUID   string
	State  State
	Reason string
	// PID of the QEMU process; 0 when the domain is not active.
	PID int
	// VMI identifies the VMI the domain runs; zero for a domain nodevirt
	// did not define (HasVMI false).
	VMI    domain.Metadata
	HasVMI bool
}

// List describes every domain of the libvirtd, active or not.
func (m *Manager) List(ctx context.Context) ([]DomainInfo, error) {
	conn, err := m.connection()
	if err != nil {
		return nil, fmt.Errorf("list domains: %w", err)
	}
	defer conn.Close()
	doms, err := conn.ListAllDomains(0)
	if err != nil {
		return nil, fmt.Errorf("list domains: %w", err)
	}
	var out []DomainInfo
	var errs []error
	for i := range doms {
		info, err := m.describe(&doms[i])
		doms[i].Free()
		if libvirtCode(err) == libvirt.ERR_NO_DOMAIN {
			continue // went away while listing
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, info)
	}
	return out, errors.Join(errs...)
}

// Lookup describes one domain.
func (m *Manager) Lookup(ctx context.Context, name string) (DomainInfo, error) {
	var info DomainInfo
	err := m.withDomain(name, func(d *libvirt.Domain) error {
		var err error
		info, err = m.describe(d)
		if err != nil {
			return wrapErr(name, err)
		}
		return nil
	})
	return info, err
}

func (m *Manager) describe(d *libvirt.Domain) (DomainInfo, error) {
	var info DomainInfo
	var err error
	if info.Name, err = d.GetName(); err != nil {
		return info, err
	}
	if info.UUID, err = d.GetUUIDString(); err != nil {
		return info, err
	}
	state, reason, err := d.GetState()
	if err != nil {
		return info, err
	}
	info.State = State(state)
	info.Reason = stateReason(info.State, reason)
	if info.State.Active() {
		info.PID = m.qemuPID(info.Name)
	}
	md, err := d.GetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, domain.MetadataNamespace, libvirt.DOMAIN_AFFECT_CURRENT)
	switch {
	case libvirtCode(err) == libvirt.ERR_NO_DOMAIN_METADATA:
	case err != nil:
		return info, err
	default:
		info.VMI, info.HasVMI, err = domain.ParseMetadata(md)
		if err != nil {
			return info, err
		}
	}
	return info, nil
}

// qemuPID reads libvirtd's pid file of an active domain; 0 when unreadable.
func (m *Manager) qemuPID(name string) int {
	b, err := os.ReadFile(filepath.Join(m.cfg.PIDDir, name+".pid"))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil {
		return 0
	}
	return pid
}

// DomainXML returns the domain's live definition (the persistent one when
// inactive), with what libvirt filled in: PCI addresses, generated MACs,
// the VNC socket path, pty paths.
func (m *Manager) DomainXML(ctx context.Context, name string) (*libvirtxml.Domain, error) {
	var dom libvirtxml.Domain
	err := m.withDomain(name, func(d *libvirt.Domain) error {
		doc, err := d.GetXMLDesc(0)
		if err != nil {
			return wrapErr(name, err)
		}
		if err := dom.Unmarshal(doc); err != nil {
			return fmt.Errorf("domain %s: parse xml: %w", name, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &dom, nil
}

// AllDomainStats returns libvirt's statistics of every domain flags select
// (virConnectGetAllDomainStats), read over one of the Manager's
// connections: whoever reads statistics of the node's domains shares them
// instead of opening connections of its own. The caller frees each
// DomainStats.Domain.
func (m *Manager) AllDomainStats(stats libvirt.DomainStatsTypes, flags libvirt.ConnectGetAllDomainStatsFlags) ([]libvirt.DomainStats, error) {
	conn, err := m.connection()
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	all, err := conn.GetAllDomainStats(nil, stats, flags)
	if err != nil {
		return nil, fmt.Errorf("get domain statistics: %w", err)
	}
	return all, nil
}
