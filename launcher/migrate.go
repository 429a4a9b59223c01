package launcher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"
)

// MigrateOptions tune Migrate.
type MigrateOptions struct {
	// DestURI is the target node's libvirtd as the source's libvirtd
	// reaches it (peer to peer): qemu+tls://<ip>/system in production,
	// qemu+tcp://<ip>/system in the lab.
	DestURI string
	// DestXML is the domain as the target runs it (its own disk paths,
	// state directory and taps); empty keeps the source's definition.
	DestXML string
	// CopyStorage mirrors every writable disk to the target over NBD
	// (libvirt's copy-storage-all); the target's files must exist with the
	// same virtual size.
	CopyStorage bool
	// SharedUnsafe skips libvirt's check that disks not copied are on
	// storage libvirt knows to be shared (a directory seen by every node
	// is not, to libvirt 9.0).
	SharedUnsafe bool
	// BandwidthMiBs limits the transfer (MiB/s); 0 is unlimited.
	BandwidthMiBs uint64
	// AutoConverge throttles the guest's vCPUs when memory does not
	// converge.
	AutoConverge bool
	// CopyDisks names the disks (target devs) CopyStorage copies; empty:
	// every writable disk.
	CopyDisks []string
	// ProgressTimeout aborts the migration when the data remaining has not
	// shrunk for this long (KubeVirt's progressTimeout); 0: never.
	ProgressTimeout time.Duration
	// TLS encrypts the migration stream itself (memory and NBD disk
	// copy) with QEMU's native TLS (VIR_MIGRATE_TLS): both nodes' qemu.conf
	// name the certificates (migrate_tls_x509_cert_dir).
	TLS bool
	// PostCopyAfter lets the migration switch to post-copy
	// (VIR_MIGRATE_POSTCOPY: the guest runs on the target and pulls the
	// pages still missing) once it has run that long without completing,
	// KubeVirt's allowPostCopy; 0: pre-copy only. A migration in post-copy
	// can no longer be aborted. OnPostCopy is called after the switch.
	PostCopyAfter time.Duration
	OnPostCopy    func()
	// MaxDowntime is the longest pause of the guest at switchover libvirt
	// may choose (KubeVirt's maxDowntimeMs); 0 keeps QEMU's default
	// (300 ms).
	MaxDowntime time.Duration
	// OnProgress, when set, is called with the job's progress about every
	// half second while it runs (from another goroutine).
	OnProgress func(MigrationProgress)
}

// ErrNoProgress is wrapped by Migrate's error when ProgressTimeout aborted
// the job.
var ErrNoProgress = errors.New("the migration made no progress")

// MigrationStats are libvirt's statistics of a completed migration, read
// on the source.
type MigrationStats struct {
	Elapsed  time.Duration
	Downtime time.Duration
	// DataBytes is everything sent (memory and disks); MemoryBytes the
	// memory part.
	DataBytes   uint64
	MemoryBytes uint64
}

// MigrationProgress is libvirt's view of a running migration job, read on
// the source: bytes of memory and disks in all, sent and left, and the
// rates, in bytes per second.
type MigrationProgress struct {
	DataTotal, DataProcessed, DataRemaining uint64
	MemoryRate, DiskRate                    uint64
	// DirtyRate is how fast the guest dirties its memory (libvirt counts
	// pages; this is pages times the page size).
	DirtyRate uint64
}

func progressOf(js *libvirt.DomainJobInfo) MigrationProgress {
	return MigrationProgress{DataTotal: js.DataTotal, DataProcessed: js.DataProcessed, DataRemaining: js.DataRemaining,
		MemoryRate: js.MemBps, DiskRate: js.DiskBps, DirtyRate: js.MemDirtyRate * js.MemPageSize}
}

// ErrMigrationAborted is wrapped by Migrate's error when AbortMigration
// cancelled the job.
var ErrMigrationAborted = errors.New("migration aborted")

// Migrate live-migrates the running domain name peer to peer to
// opts.DestURI and leaves it persistent there; the source keeps its
// (inactive) definition, which the caller undefines. It blocks until the
// migration ends. A failed migration leaves the guest running here.
func (m *Manager) Migrate(ctx context.Context, name string, opts MigrateOptions) (MigrationStats, error) {
	if opts.DestURI == "" {
		return MigrationStats{}, errors.New("migrate: no destination uri")
	}
	params := &libvirt.DomainMigrateParameters{}
	if opts.DestXML != "" {
		params.DestXMLSet, params.DestXML = true, opts.DestXML
		params.PersistXMLSet, params.PersistXML = true, opts.DestXML
	}
	if opts.BandwidthMiBs > 0 {
		params.BandwidthSet, params.Bandwidth = true, opts.BandwidthMiBs
	}
	flags := migrateFlags(opts)
	if opts.CopyStorage && len(opts.CopyDisks) > 0 {
		params.MigrateDisksSet, params.MigrateDisks = true, opts.CopyDisks
	}
	var stats MigrationStats
	err := m.withDomain(name, func(d *libvirt.Domain) error {
		done := make(chan struct{})
		stalled := make(chan struct{})
		defer close(done)
		go watchJob(ctx, d, opts, done, stalled)
		if err := d.MigrateToURI3(opts.DestURI, params, flags); err != nil {
			select {
			case <-stalled:
				return fmt.Errorf("migrate %s: %w for %s: %w", name, ErrNoProgress, opts.ProgressTimeout, err)
			default:
			}
			if libvirtCode(err) == libvirt.ERR_OPERATION_ABORTED || ctx.Err() != nil {
				return fmt.Errorf("migrate %s: %w: %w", name, ErrMigrationAborted, err)
			}
			return fmt.Errorf("migrate %s to %s: %w", name, opts.DestURI, err)
		}
		if js, err := d.GetJobStats(libvirt.DOMAIN_JOB_STATS_COMPLETED); err == nil {
			stats.Elapsed = time.Duration(js.TimeElapsed) * time.Millisecond
			stats.Downtime = time.Duration(js.Downtime) * time.Millisecond
			stats.DataBytes, stats.MemoryBytes = js.DataProcessed, js.MemProcessed
		}
		return nil
	})
	return stats, err
}

// migrateFlags are libvirt's flags for opts: always live, peer to peer and
// persistent on the target.
func migrateFlags(opts MigrateOptions) libvirt.DomainMigrateFlags {
	flags := libvirt.MIGRATE_LIVE | libvirt.MIGRATE_PEER2PEER | libvirt.MIGRATE_PERSIST_DEST
	for _, f := range []struct {
		on   bool
		flag libvirt.DomainMigrateFlags
	}{
		{opts.CopyStorage, libvirt.MIGRATE_NON_SHARED_DISK}, {opts.SharedUnsafe, libvirt.MIGRATE_UNSAFE},
		{opts.AutoConverge, libvirt.MIGRATE_AUTO_CONVERGE}, {opts.TLS, libvirt.MIGRATE_TLS},
		{opts.PostCopyAfter > 0, libvirt.MIGRATE_POSTCOPY},
	} {
		if f.on {
			flags |= f.flag
		}
	}
	return flags
}

// watchJob follows a running migration job of d until done: it reports
// the job's progress to opts.OnProgress each tick, aborts the job when ctx
// ends or when the data remaining has not shrunk for opts.ProgressTimeout
// (closing stalled first), sets opts.MaxDowntime once the job runs, and
// switches to post-copy after opts.PostCopyAfter (after which nothing
// aborts it).
func watchJob(ctx context.Context, d *libvirt.Domain, opts MigrateOptions, done <-chan struct{}, stalled chan<- struct{}) {
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	var least uint64
	start := time.Now()
	lastProgress := start
	downtimeSet := opts.MaxDowntime <= 0
	postCopy := false
	for {
		select {
		case <-ctx.Done():
			// Cancelled: abort the job; MigrateToURI3 then returns.
			_ = d.AbortJob()
			return
		case <-done:
			return
		case <-tick.C:
		}
		info, err := d.GetJobStats(0)
		if err != nil || info.Type == libvirt.DOMAIN_JOB_NONE {
			continue
		}
		if opts.OnProgress != nil {
			opts.OnProgress(progressOf(info))
		}
		if !downtimeSet {
			downtimeSet = d.MigrateSetMaxDowntime(uint64(opts.MaxDowntime/time.Millisecond), 0) == nil
		}
		if opts.PostCopyAfter > 0 && !postCopy && time.Since(start) >= opts.PostCopyAfter {
			if postCopy = d.MigrateStartPostCopy(0) == nil; postCopy && opts.OnPostCopy != nil {
				opts.OnPostCopy()
			}
		}
		if postCopy || opts.ProgressTimeout <= 0 || !info.DataRemainingSet {
			continue
		}
		if least == 0 || info.DataRemaining < least {
			least, lastProgress = info.DataRemaining, time.Now()
			continue
		}
		if time.Since(lastProgress) > opts.ProgressTimeout {
			close(stalled)
			_ = d.AbortJob()
			return
		}
	}
}

// RemoteDomainXML is the migratable XML of the domain name as the libvirtd
// at uri has it defined (the target node's preparation).
func RemoteDomainXML(uri, name string) (string, error) {
	conn, err := libvirt.NewConnect(uri)
	if err != nil {
		return "", fmt.Errorf("connect to %s: %w", uri, err)
	}
	defer conn.Close()
	d, err := conn.LookupDomainByName(name)
	if err != nil {
		return "", wrapErr(name, err)
	}
	defer d.Free()
	doc, err := d.GetXMLDesc(libvirt.DOMAIN_XML_MIGRATABLE | libvirt.DOMAIN_XML_INACTIVE)
	if err != nil {
		return "", fmt.Errorf("domain %s on %s: %w", name, uri, err)
	}
	return doc, nil
}

// RemoteDiskCapacities is the virtual size in bytes of every disk of the
// domain name at the libvirtd at uri, by the disk's user alias ("ua-<volume
// name>"): what the target of a storage copy must create.
func RemoteDiskCapacities(uri, name string) (map[string]uint64, error) {
	conn, err := libvirt.NewConnect(uri)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", uri, err)
	}
	defer conn.Close()
	d, err := conn.LookupDomainByName(name)
	if err != nil {
		return nil, wrapErr(name, err)
	}
	defer d.Free()
	doc, err := d.GetXMLDesc(0)
	if err != nil {
		return nil, fmt.Errorf("domain %s on %s: %w", name, uri, err)
	}
	dom := &libvirtxml.Domain{}
	if err := dom.Unmarshal(doc); err != nil {
		return nil, fmt.Errorf("domain %s on %s: %w", name, uri, err)
	}
	out := map[string]uint64{}
	if dom.Devices == nil {
		return out, nil
	}
	for _, disk := range dom.Devices.Disks {
		if disk.Alias == nil || disk.Target == nil {
			continue
		}
		info, err := d.GetBlockInfo(disk.Target.Dev, 0)
		if err != nil {
			return nil, fmt.Errorf("domain %s disk %s: %w", name, disk.Target.Dev, err)
		}
		out[disk.Alias.Name] = info.Capacity
	}
	return out, nil
}
