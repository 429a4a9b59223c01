package handler

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// errSpec marks a VMI spec the node cannot run, now or later: the VMI fails.
var errSpec = errors.New("invalid spec")

// permanent reports whether a start error will not go away by retrying.
func permanent(err error) bool {
	var fe *domain.FieldError
	return errors.As(err, &fe) || errors.Is(err, domain.ErrNotSupported) || errors.Is(err, errSpec) || errors.Is(err, errPodNetwork)
}

// lookup describes the domain, found false when it does not exist.
func lookup(ctx context.Context, lv *launcher.Manager, name string) (launcher.DomainInfo, bool, error) {
	info, err := lv.Lookup(ctx, name)
	if errors.Is(err, launcher.ErrNotFound) {
		return launcher.DomainInfo{}, false, nil
	}
	if err != nil {
		return launcher.DomainInfo{}, false, err
	}
	return info, true, nil
}

// sync reconciles the VMI namespace/name (key) with its domain.
func (h *Handler) sync(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	lv, err := h.manager()
	if err != nil {
		return err
	}
	domName := domain.Name(ns, name)
	info, found, err := lookup(ctx, lv, domName)
	if err != nil {
		return err
	}
	obj, exists, err := h.vmis.GetIndexer().GetByKey(key)
	if err != nil {
		return err
	}
	if !exists {
		return h.cleanupGone(ctx, lv, ns, name, info, found)
	}
	vmi := obj.(*v1.VirtualMachineInstance)
	if vmi.Status.NodeName != "" && vmi.Status.NodeName != h.cfg.NodeName {
		return nil
	}
	if !vmi.IsFinal() && vmi.DeletionTimestamp == nil && h.migratingAway(vmi, info, found) {
		// The guest runs (or is about to run) on the migration's
		// target; the brain moves the VMI there.
		return nil
	}
	if found && (!info.HasVMI || types.UID(info.VMI.UID) != vmi.UID) {
		if !info.HasVMI || !h.owns(types.UID(info.VMI.UID)) {
			return h.syncFailed(ctx, vmi, fmt.Errorf("libvirt domain %s exists and does not belong to this vmi", domName))
		}
		// The domain of an earlier VMI of the same name.
		if err := h.cleanup(ctx, lv, types.UID(info.VMI.UID), domName); err != nil {
			return err
		}
		found = false
	}
	switch {
	case vmi.IsFinal():
		return h.finish(ctx, lv, vmi, found)
	case vmi.DeletionTimestamp != nil:
		if found && info.State.Active() {
			h.beginShutdown(lv, vmi, remainingGrace(vmi, time.Now()))
			return h.observe(ctx, lv, vmi, info, true)
		}
		if vmi.Status.Phase == v1.Running {
			return h.observe(ctx, lv, vmi, info, found)
		}
		return h.finish(ctx, lv, vmi, found)
	case vmi.Status.Phase == v1.Scheduled:
		if found && info.State.Active() {
			return h.observe(ctx, lv, vmi, info, true)
		}
		started, err := h.start(ctx, lv, vmi)
		if err != nil {
			return h.startFailed(ctx, vmi, err)
		}
		if info, found, err = lookup(ctx, lv, domName); err != nil {
			return err
		}
		return h.observe(ctx, lv, started, info, found)
	case vmi.Status.Phase == v1.Running:
		return h.observe(ctx, lv, vmi, info, found)
	}
	return nil
}

// start makes everything the VMI's domain needs and starts it. It returns
// the VMI as updated on the server (with the finalizer).
func (h *Handler) start(ctx context.Context, lv *launcher.Manager, vmi *v1.VirtualMachineInstance) (*v1.VirtualMachineInstance, error) {
	log := h.log.With("vmi", vmi.Namespace+"/"+vmi.Name)
	taps, err := h.plannedTaps(ctx, vmi)
	if err != nil {
		return nil, err
	}
	disks, err := h.resolveDisks(ctx, vmi)
	if err != nil {
		return nil, err
	}
	if err := h.resolveContainerDisks(ctx, vmi, disks); err != nil {
		return nil, err
	}
	if err := h.resolveHostDisks(vmi, disks); err != nil {
		return nil, err
	}
	secrets, err := h.resolveSecrets(ctx, vmi)
	if err != nil {
		return nil, err
	}
	configMaps, err := h.resolveConfigMaps(ctx, vmi)
	if err != nil {
		return nil, err
	}
	env := domain.Env{
		Emulation:  h.emulation(),
		StateDir:   h.vmDir(vmi.UID),
		Disks:      disks,
		Taps:       plannedDomainTaps(taps),
		Secrets:    secrets,
		ConfigMaps: configMaps,
	}
	// The spec is checked against the plan before anything is made on the
	// host; the domain itself is built from what the attaches made.
	if _, err := domain.Convert(vmi, env); err != nil {
		return nil, err
	}
	if vmi, err = h.ensureFinalizer(ctx, vmi); err != nil {
		return nil, err
	}
	// The taps are recorded once, as planned, before any exists: whatever
	// happens next, the record is what removes them.
	rec := &record{UID: vmi.UID, Namespace: vmi.Namespace, Name: vmi.Name, Domain: domain.Name(vmi.Namespace, vmi.Name), Taps: taps}
	if err := h.writeRecord(rec); err != nil {
		return nil, err
	}
	if env.Taps, err = h.attachTaps(ctx, vmi, taps); err != nil {
		return nil, err
	}
	dom, err := domain.Convert(vmi, env)
	if err != nil {
		return nil, err
	}
	h.markAdopted(vmi.UID, true)
	if err := domain.Prepare(ctx, vmi, env); err != nil {
		return nil, err
	}
	t0 := time.Now()
	if err := lv.Create(ctx, dom, launcher.StartOptions{Paused: domain.StartPaused(vmi)}); err != nil {
		return nil, err
	}
	log.Info("domain started", "domain", dom.Name, "emulation", env.Emulation, "paused", domain.StartPaused(vmi),
		"took", time.Since(t0).Round(time.Millisecond))
	return vmi, nil
}

// startFailed records a failed start: a spec the node cannot run fails the
// VMI, anything else is retried with the reason on the Synchronized
// condition.
func (h *Handler) startFailed(ctx context.Context, vmi *v1.VirtualMachineInstance, err error) error {
	if !permanent(err) {
		if werr := h.syncFailed(ctx, vmi, err); werr != nil {
			return errors.Join(err, werr)
		}
		if pulling(err) {
			// The pull's end queues the VMI again: no polling meanwhile.
			return nil
		}
		return err
	}
	h.log.Warn("vmi cannot run on this node", "vmi", vmi.Namespace+"/"+vmi.Name, "err", err)
	out := vmi.DeepCopy()
	setPhase(out, v1.Failed)
	out.Status.Reason = "FailedCreate"
	setCondition(out, v1.VirtualMachineInstanceSynchronized, false, "FailedCreate", err.Error())
	setCondition(out, v1.VirtualMachineInstanceReady, false, v1.GuestNotRunningReason, "the domain could not be created")
	_, werr := h.write(ctx, vmi, out)
	return werr
}

// syncFailed puts err on the Synchronized condition.
func (h *Handler) syncFailed(ctx context.Context, vmi *v1.VirtualMachineInstance, err error) error {
	reason := "FailedCreate"
	if errors.Is(err, errWaiting) {
		reason = "Waiting"
	}
	if r := pullReason(err); r != "" {
		reason = r
	}
	out := vmi.DeepCopy()
	setCondition(out, v1.VirtualMachineInstanceSynchronized, false, reason, err.Error())
	_, werr := h.write(ctx, vmi, out)
	if prev := conditionOf(vmi, v1.VirtualMachineInstanceSynchronized); prev == nil || prev.Reason != reason || prev.Message != err.Error() {
		h.pullEvent(vmi, err)
	}
	return werr
}

// remainingGrace is what is left of the termination grace period, counted
// from the deletion.
func remainingGrace(vmi *v1.VirtualMachineInstance, now time.Time) time.Duration {
	grace := DefaultGracePeriod
	if s := vmi.Spec.TerminationGracePeriodSeconds; s != nil {
		grace = time.Duration(*s) * time.Second
	}
	if dt := vmi.DeletionTimestamp; dt != nil {
		grace -= now.Sub(dt.Time)
	}
	return max(grace, 0)
}

// beginShutdown shuts the domain down gracefully in the background (once
// per VMI) and reconciles the VMI when that is over.
func (h *Handler) beginShutdown(lv *launcher.Manager, vmi *v1.VirtualMachineInstance, grace time.Duration) {
	h.mu.Lock()
	ctx := h.runCtx
	if h.stopping[vmi.UID] || ctx == nil {
		h.mu.Unlock()
		return
	}
	h.stopping[vmi.UID] = true
	h.mu.Unlock()
	key := vmi.Namespace + "/" + vmi.Name
	name := domain.Name(vmi.Namespace, vmi.Name)
	h.log.Info("shutting down", "vmi", key, "grace", grace)
	h.bg.Add(1)
	go func() {
		defer h.bg.Done()
		if err := lv.Shutdown(ctx, name, grace); err != nil && ctx.Err() == nil {
			h.log.Error("shutdown", "vmi", key, "err", err)
			h.mu.Lock()
			delete(h.stopping, vmi.UID)
			h.mu.Unlock()
		}
		h.queue.Add(key)
	}()
}

func (h *Handler) isStopping(uid types.UID) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stopping[uid]
}

// finish cleans up after a final (or deleted, never started) VMI and drops
// the finalizer.
func (h *Handler) finish(ctx context.Context, lv *launcher.Manager, vmi *v1.VirtualMachineInstance, found bool) error {
	if found || h.owns(vmi.UID) {
		if err := h.cleanup(ctx, lv, vmi.UID, domain.Name(vmi.Namespace, vmi.Name)); err != nil {
			return err
		}
	} else if hasContainerDisk(vmi) {
		// An image may have been pulled for it before it failed to start.
		if err := h.releaseContainerDisks(string(vmi.UID)); err != nil {
			return err
		}
	}
	if !slices.Contains(vmi.Finalizers, Finalizer) {
		return nil
	}
	out := vmi.DeepCopy()
	out.Finalizers = slices.DeleteFunc(out.Finalizers, func(f string) bool { return f == Finalizer })
	_, err := h.write(ctx, vmi, out)
	return err
}

// cleanupGone cleans up after a VMI that no longer exists: its domain (if
// this handler made it) and every state record of that name.
func (h *Handler) cleanupGone(ctx context.Context, lv *launcher.Manager, ns, name string, info launcher.DomainInfo, found bool) error {
	var errs []error
	domName := domain.Name(ns, name)
	if found && info.HasVMI && h.owns(types.UID(info.VMI.UID)) {
		if r, err := h.readRecord(types.UID(info.VMI.UID)); err != nil || (r != nil && r.Migration != "") {
			// An incoming migration's domain (or an unreadable record).
			return err
		}
		errs = append(errs, h.cleanup(ctx, lv, types.UID(info.VMI.UID), domName))
	}
	recs, err := h.recordsOf(ns, name)
	errs = append(errs, err)
	for _, r := range recs {
		if r.Migration != "" {
			// Prepared for an incoming migration (migration.go).
			continue
		}
		if found && string(r.UID) != info.VMI.UID {
			// The domain of that name is not this record's: keep it.
			errs = append(errs, h.cleanupState(ctx, r))
			continue
		}
		errs = append(errs, h.cleanup(ctx, lv, r.UID, domName))
	}
	return errors.Join(errs...)
}

// cleanup destroys and undefines the domain of VMI uid, detaches its taps
// and removes its state. The caller checked that the domain is uid's.
func (h *Handler) cleanup(ctx context.Context, lv *launcher.Manager, uid types.UID, domName string) error {
	if err := lv.Undefine(ctx, domName); err != nil {
		return err
	}
	r, err := h.readRecord(uid)
	if err != nil {
		return err
	}
	if r == nil {
		r = &record{UID: uid}
	}
	if err := h.cleanupState(ctx, r); err != nil {
		return err
	}
	h.mu.Lock()
	delete(h.stopping, uid)
	delete(h.adopted, uid)
	delete(h.migratedAway, uid)
	h.mu.Unlock()
	h.log.Info("domain cleaned up", "domain", domName, "uid", uid)
	return nil
}

// cleanupState detaches a record's taps and removes its directory.
func (h *Handler) cleanupState(ctx context.Context, r *record) error {
	if err := h.detachTaps(ctx, r); err != nil {
		return err
	}
	if err := os.RemoveAll(h.vmDir(r.UID)); err != nil {
		return fmt.Errorf("remove state of vmi %s: %w", r.UID, err)
	}
	return h.releaseContainerDisks(string(r.UID))
}
