package handler

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// The node's half of a live migration (the protocol is package migstate's):
// as the target it prepares what the guest needs here and defines the
// domain, as the source it runs libvirt's peer-to-peer migration to the
// target's libvirtd. What it writes goes to the migration's status only;
// the brain moves the VMI.

// Migration transports between the nodes' libvirt daemons.
const (
	// TransportTLS is libvirt's TLS transport (qemu+tls) with the nodes'
	// certificates of the node CA, mutually checked (the client checks the
	// target's certificate against its address), and QEMU's native TLS
	// for the migration stream (memory, NBD disk copy) with the same
	// certificates: the production setting.
	TransportTLS = "tls"
	// TransportTCP is plain TCP without authentication (qemu+tcp), the
	// stream in clear: for a lab on one machine only.
	TransportTCP = "tcp"
)

// migrationURI is the libvirt URI of the target node's libvirtd at addr.
func (h *Handler) migrationURI(addr string) string {
	host := addr
	if ip := net.ParseIP(addr); ip != nil && ip.To4() == nil {
		host = "[" + addr + "]"
	}
	uri := "qemu+" + h.cfg.MigrationTransport + "://" + host + "/system"
	if h.cfg.MigrationTransport == TransportTLS && h.cfg.MigrationPKIDir != "" {
		// libvirt takes the path as it is; validate keeps it plain.
		uri += "?pkipath=" + h.cfg.MigrationPKIDir
	}
	return uri
}

// Migration metrics of the source node (KubeVirt's names where it has
// them).
var (
	migrationsEnded = metrics.Default().Counter("kubevirt_vmi_migrations_ended_total",
		"Live migrations this node ran as the source, by result.", "result")
	migrationDuration = metrics.Default().Histogram("kubevirt_vmi_migration_duration_seconds",
		"Duration of the libvirt migration job on the source node.", metrics.LatencyBuckets)
	migrationDowntime = metrics.Default().Histogram("kubevirt_vmi_migration_downtime_seconds",
		"Guest downtime of completed live migrations (libvirt's job statistics).", metrics.LatencyBuckets)
	migrationData = metrics.Default().Counter("kubevirt_vmi_migration_data_processed_bytes_total",
		"Bytes sent by completed live migrations (memory and copied disks).")
)

// The running migrations' progress, KubeVirt's gauges: one series per
// VMI this node migrates away, there only while the job runs.
var (
	progressLabels    = []string{"node", "namespace", "name"}
	migrationTotal    = metrics.Default().Gauge("kubevirt_vmi_migration_data_total_bytes", "The total Guest OS data to be migrated to the new VM.", progressLabels...)
	migrationSent     = metrics.Default().Gauge("kubevirt_vmi_migration_data_processed_bytes", "The total Guest OS data processed and migrated to the new VM.", progressLabels...)
	migrationLeft     = metrics.Default().Gauge("kubevirt_vmi_migration_data_remaining_bytes", "The remaining guest OS data to be migrated to the new VM.", progressLabels...)
	migrationMemRate  = metrics.Default().Gauge("kubevirt_vmi_migration_memory_transfer_rate_bytes", "The rate at which the memory is being transferred.", progressLabels...)
	migrationDiskRate = metrics.Default().Gauge("kubevirt_vmi_migration_disk_transfer_rate_bytes", "The rate at which the disk is being transferred.", progressLabels...)
	migrationDirty    = metrics.Default().Gauge("kubevirt_vmi_migration_dirty_memory_rate_bytes", "The rate of memory being dirty in the Guest OS.", progressLabels...)
	progressGauges    = []*metrics.GaugeVec{migrationTotal, migrationSent, migrationLeft, migrationMemRate, migrationDiskRate, migrationDirty}
)

// reportProgress returns the OnProgress of a migration of vmi from node,
// and the function that drops its series when the migration ends.
func reportProgress(node string, vmi *v1.VirtualMachineInstance) (func(launcher.MigrationProgress), func()) {
	labels := []string{node, vmi.Namespace, vmi.Name}
	report := func(p launcher.MigrationProgress) {
		for i, v := range []uint64{p.DataTotal, p.DataProcessed, p.DataRemaining, p.MemoryRate, p.DiskRate, p.DirtyRate} {
			progressGauges[i].With(labels...).Set(float64(v))
		}
	}
	return report, func() {
		for _, g := range progressGauges {
			g.Delete(labels...)
		}
	}
}

func observeMigration(s launcher.MigrationStats, err error) {
	if err != nil {
		migrationsEnded.With("failed").Inc()
		return
	}
	migrationsEnded.With("succeeded").Inc()
	migrationDuration.With().Observe(s.Elapsed.Seconds())
	migrationDowntime.With().Observe(s.Downtime.Seconds())
	migrationData.With().Add(float64(s.DataBytes))
}

// syncMigration plays this node's part in the migration namespace/name.
func (h *Handler) syncMigration(ctx context.Context, key string) error {
	obj, exists, err := h.migrations.GetIndexer().GetByKey(key)
	if err != nil {
		return err
	}
	if !exists {
		return h.sweepTargets(ctx)
	}
	mig := obj.(*v1.VirtualMachineInstanceMigration)
	st := mig.Status.MigrationState
	if st == nil {
		return nil
	}
	switch h.cfg.NodeName {
	case st.TargetNode:
		return h.syncTarget(ctx, mig)
	case st.SourceNode:
		return h.syncSource(ctx, mig)
	}
	return nil
}

// syncSource starts the migration of a VMI running here once the target is
// ready, and aborts it when asked.
func (h *Handler) syncSource(ctx context.Context, mig *v1.VirtualMachineInstanceMigration) error {
	st := mig.Status.MigrationState
	if migstate.Final(mig) || migstate.Ended(st) {
		return nil
	}
	h.mu.Lock()
	cancel, running := h.migrating[mig.UID]
	h.mu.Unlock()
	abort := st.AbortRequested || mig.DeletionTimestamp != nil
	switch {
	case running && abort:
		h.log.Info("aborting migration", "migration", mig.Namespace+"/"+mig.Name)
		cancel()
		return nil
	case running:
		return nil
	case abort && st.StartTimestamp == nil:
		// Never started: nothing to abort.
		return migstate.UpdateState(ctx, h.cfg.Virt, mig.Namespace, mig.Name, func(_ *v1.VirtualMachineInstanceMigration, s *v1.VirtualMachineInstanceMigrationState) bool {
			now := metav1.Now()
			s.Completed, s.Failed, s.EndTimestamp = true, true, &now
			s.AbortStatus, s.FailureReason = v1.MigrationAbortSucceeded, "migration aborted before it started"
			return true
		})
	case st.StartTimestamp != nil:
		// Started by an earlier run of this agent, whose libvirt call
		// ended with it: where is the guest?
		return h.settleOrphan(ctx, mig)
	case st.TargetNodeAddress == "":
		return nil
	}
	obj, ok, err := h.vmis.GetIndexer().GetByKey(mig.Namespace + "/" + mig.Spec.VMIName)
	if err != nil || !ok {
		return err
	}
	vmi := obj.(*v1.VirtualMachineInstance)
	if vmi.Status.NodeName != h.cfg.NodeName || vmi.Status.Phase != v1.Running {
		return nil
	}
	if err := migstate.UpdateState(ctx, h.cfg.Virt, mig.Namespace, mig.Name, func(_ *v1.VirtualMachineInstanceMigration, s *v1.VirtualMachineInstanceMigrationState) bool {
		now := metav1.Now()
		s.StartTimestamp, s.Mode = &now, v1.MigrationPreCopy
		return true
	}); err != nil {
		return err
	}
	h.mu.Lock()
	runCtx := h.runCtx
	jobCtx, cancelJob := context.WithCancel(runCtx)
	h.migrating[mig.UID] = cancelJob
	h.mu.Unlock()
	h.bg.Add(1)
	go func() {
		defer h.bg.Done()
		defer cancelJob()
		h.migrate(jobCtx, runCtx, mig, vmi, st.TargetNodeAddress)
		h.mu.Lock()
		delete(h.migrating, mig.UID)
		h.mu.Unlock()
	}()
	return nil
}

// migrate runs the libvirt migration of vmi's domain to the target at addr
// and reports its end on the migration.
func (h *Handler) migrate(jobCtx, runCtx context.Context, mig *v1.VirtualMachineInstanceMigration, vmi *v1.VirtualMachineInstance, addr string) {
	log := h.log.With("migration", mig.Namespace+"/"+mig.Name, "vmi", vmi.Namespace+"/"+vmi.Name, "target", mig.Status.MigrationState.TargetNode)
	conf := mig.Status.MigrationState.VMIMConfigurationOptions
	var diskBytes int64
	if locals, err := h.localClaims(jobCtx, vmi); err == nil {
		for _, l := range locals {
			diskBytes += l.pv.Spec.Capacity.Storage().Value()
		}
	}
	limit := completionTimeout(vmi, conf, diskBytes)
	postCopyAfter, deadline := migrationDeadlines(conf, limit)
	timed, cancel := context.WithTimeout(jobCtx, deadline)
	defer cancel()
	onPostCopy := func() {
		log.Info("switched to post-copy", "after", postCopyAfter)
		if err := migstate.UpdateState(runCtx, h.cfg.Virt, mig.Namespace, mig.Name, func(_ *v1.VirtualMachineInstanceMigration, s *v1.VirtualMachineInstanceMigrationState) bool {
			s.Mode = v1.MigrationPostCopy
			return true
		}); err != nil {
			log.Warn("reporting post-copy", "err", err)
		}
	}
	stats, err := h.runLibvirtMigration(timed, vmi, addr, conf, postCopyAfter, onPostCopy)
	aborted := errors.Is(err, launcher.ErrMigrationAborted) && jobCtx.Err() != nil
	if err != nil && jobCtx.Err() == nil && timed.Err() != nil {
		err = fmt.Errorf("the migration did not complete within %s (completionTimeoutPerGiB): %w", deadline, err)
	}
	if err == nil {
		h.mu.Lock()
		h.migratedAway[vmi.UID] = true
		h.mu.Unlock()
		log.Info("migrated", "elapsed", stats.Elapsed, "downtime", stats.Downtime, "data_bytes", stats.DataBytes,
			"memory_bytes", stats.MemoryBytes)
		h.recorder.Eventf(vmi, k8sv1.EventTypeNormal, "Migrated", "The VirtualMachineInstance migrated to node %s (downtime %s).",
			mig.Status.MigrationState.TargetNode, stats.Downtime)
	} else {
		log.Warn("migration failed", "aborted", aborted, "err", err)
	}
	observeMigration(stats, err)
	if werr := migstate.UpdateState(runCtx, h.cfg.Virt, mig.Namespace, mig.Name, func(_ *v1.VirtualMachineInstanceMigration, s *v1.VirtualMachineInstanceMigrationState) bool {
		now := metav1.Now()
		s.EndTimestamp, s.Completed = &now, true
		if err != nil {
			s.Failed, s.FailureReason = true, err.Error()
		}
		if aborted {
			s.AbortStatus = v1.MigrationAbortSucceeded
		} else if s.AbortRequested {
			s.AbortStatus = v1.MigrationAbortFailed
		}
		return true
	}); werr != nil {
		log.Error("reporting the migration's end", "err", werr)
		h.migQueue.AddAfter(mig.Namespace+"/"+mig.Name, time.Second)
	}
	h.queue.Add(vmi.Namespace + "/" + vmi.Name)
}

// runLibvirtMigration migrates vmi's domain: the target's own definition
// (its paths) as the destination XML, node-local disks copied.
func (h *Handler) runLibvirtMigration(ctx context.Context, vmi *v1.VirtualMachineInstance, addr string, conf *v1.VMIMConfigurationOptions,
	postCopyAfter time.Duration, onPostCopy func()) (launcher.MigrationStats, error) {
	lv, err := h.manager()
	if err != nil {
		return launcher.MigrationStats{}, err
	}
	name := domain.Name(vmi.Namespace, vmi.Name)
	uri := h.migrationURI(addr)
	destXML, err := launcher.RemoteDomainXML(uri, name)
	if err != nil {
		return launcher.MigrationStats{}, fmt.Errorf("the target's domain: %w", err)
	}
	// Over TLS the stream itself is TLS too (QEMU's, with the node
	// certificates in qemu.conf's migrate_tls_x509_cert_dir), not only
	// libvirt's control connection.
	onProgress, ended := reportProgress(h.cfg.NodeName, vmi)
	defer ended()
	opts := launcher.MigrateOptions{DestURI: uri, DestXML: destXML, TLS: h.cfg.MigrationTransport == TransportTLS,
		PostCopyAfter: postCopyAfter, OnPostCopy: onPostCopy, OnProgress: onProgress}
	// Every writable disk is copied (node-local volumes, cloud-init
	// seeds, which the target made alike), except those on storage every
	// node sees: shared hostDisks and ReadWriteMany claims, which libvirt
	// 9.0 does not know to be shared (hence unsafe).
	shared, err := h.sharedVolumes(ctx, vmi)
	if err != nil {
		return launcher.MigrationStats{}, err
	}
	xml, err := lv.DomainXML(ctx, name)
	if err != nil {
		return launcher.MigrationStats{}, err
	}
	for _, d := range xml.Devices.Disks {
		if d.Target == nil || d.ReadOnly != nil || d.Device == "cdrom" {
			continue
		}
		if d.Alias != nil && shared[strings.TrimPrefix(d.Alias.Name, "ua-")] {
			opts.SharedUnsafe = true
			continue
		}
		opts.CopyDisks = append(opts.CopyDisks, d.Target.Dev)
	}
	opts.CopyStorage = len(opts.CopyDisks) > 0
	if conf != nil {
		if q := conf.BandwidthPerMigration; q != nil && q.Value() > 0 {
			opts.BandwidthMiBs = uint64((q.Value() + 1<<20 - 1) >> 20)
		}
		opts.AutoConverge = conf.AllowAutoConverge != nil && *conf.AllowAutoConverge
		if conf.ProgressTimeout != nil && *conf.ProgressTimeout > 0 {
			opts.ProgressTimeout = time.Duration(*conf.ProgressTimeout) * time.Second
		}
		if conf.MaxDowntimeMs != nil {
			opts.MaxDowntime = time.Duration(*conf.MaxDowntimeMs) * time.Millisecond
		}
	}
	return lv.Migrate(ctx, name, opts)
}

// sharedVolumes names the VMI's volumes on storage every node sees.
func (h *Handler) sharedVolumes(ctx context.Context, vmi *v1.VirtualMachineInstance) (map[string]bool, error) {
	out := map[string]bool{}
	for _, vol := range vmi.Spec.Volumes {
		if vol.HostDisk != nil {
			out[vol.Name] = true
			continue
		}
		pvc, err := h.volumeClaim(ctx, vmi, vol)
		if err != nil {
			return nil, err
		}
		if pvc != nil {
			out[vol.Name] = slices.Contains(pvc.Spec.AccessModes, k8sv1.ReadWriteMany)
		}
	}
	return out, nil
}

// completionTimeout is KubeVirt's completionTimeoutPerGiB applied to what
// moves: the guest's memory and diskBytes of copied disks (plus 10 s for
// the setup).
func completionTimeout(vmi *v1.VirtualMachineInstance, conf *v1.VMIMConfigurationOptions, diskBytes int64) time.Duration {
	perGiB := int64(150)
	if conf != nil && conf.CompletionTimeoutPerGiB != nil && *conf.CompletionTimeoutPerGiB > 0 {
		perGiB = *conf.CompletionTimeoutPerGiB
	}
	var bytes int64
	if m := vmi.Spec.Domain.Memory; m != nil && m.Guest != nil {
		bytes = m.Guest.Value()
	} else if q, ok := vmi.Spec.Domain.Resources.Requests[k8sv1.ResourceMemory]; ok {
		bytes = q.Value()
	}
	gib := max(float64(bytes+diskBytes)/(1<<30), 1.0/16)
	return time.Duration(float64(perGiB)*gib*float64(time.Second)) + 10*time.Second
}

// migrationDeadlines are when a migration switches to post-copy (0:
// never) and when it is given up: KubeVirt's allowPostCopy switches at the
// completion timeout instead of aborting, and a migration in post-copy
// cannot be aborted, so its context gets twice that as a backstop.
func migrationDeadlines(conf *v1.VMIMConfigurationOptions, limit time.Duration) (postCopyAfter, deadline time.Duration) {
	if conf != nil && conf.AllowPostCopy != nil && *conf.AllowPostCopy {
		return limit, 2 * limit
	}
	return 0, limit
}

// settleOrphan ends a migration this agent started before a restart: the
// guest is still here (failed) or it left (the migration completed).
func (h *Handler) settleOrphan(ctx context.Context, mig *v1.VirtualMachineInstanceMigration) error {
	lv, err := h.manager()
	if err != nil {
		return err
	}
	info, found, err := lookup(ctx, lv, domain.Name(mig.Namespace, mig.Spec.VMIName))
	if err != nil {
		return err
	}
	left := found && !info.State.Active() && info.Reason == "migrated"
	return migstate.UpdateState(ctx, h.cfg.Virt, mig.Namespace, mig.Name, func(_ *v1.VirtualMachineInstanceMigration, s *v1.VirtualMachineInstanceMigrationState) bool {
		now := metav1.Now()
		s.EndTimestamp, s.Completed = &now, true
		if !left {
			s.Failed, s.FailureReason = true, "the source node agent restarted during the migration"
		}
		return true
	})
}

// migratingAway reports whether the VMI's guest left (or is leaving) this
// node by migration, so that its stopped source domain is no news for the
// VMI: the brain moves it.
func (h *Handler) migratingAway(vmi *v1.VirtualMachineInstance, info launcher.DomainInfo, found bool) bool {
	h.mu.Lock()
	away := h.migratedAway[vmi.UID]
	h.mu.Unlock()
	if away {
		return true
	}
	if !found {
		return false
	}
	return (!info.State.Active() && info.Reason == "migrated") ||
		(info.State == launcher.StatePaused && info.Reason == "migration")
}

// enqueueMigration queues a migration this node takes part in.
func (h *Handler) enqueueMigration(obj any) {
	if m, ok := obj.(*v1.VirtualMachineInstanceMigration); ok {
		if st := m.Status.MigrationState; st == nil || (st.SourceNode != h.cfg.NodeName && st.TargetNode != h.cfg.NodeName) {
			return
		}
	}
	if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
		h.migQueue.Add(key)
	}
}
