package handler

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	k8sv1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
	hostpath "github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// The target node's part in a live migration (package migstate): make what
// the guest needs here, define its domain, and after the end give the
// copied volumes to their claims or remove everything made.

// syncTarget prepares this node for an incoming migration, or removes the
// preparation of one that failed.
func (h *Handler) syncTarget(ctx context.Context, mig *v1.VirtualMachineInstanceMigration) error {
	st := mig.Status.MigrationState
	log := h.log.With("migration", mig.Namespace+"/"+mig.Name, "vmi", mig.Namespace+"/"+mig.Spec.VMIName)
	vmi, err := h.cfg.Virt.VMIs.Get(ctx, mig.Namespace, mig.Spec.VMIName)
	if apierrors.IsNotFound(err) {
		// Gone: whatever was made here for it goes too.
		recs, err := h.records()
		var errs []error
		for _, r := range recs {
			if r.Migration == mig.UID {
				errs = append(errs, h.removeTarget(ctx, r))
			}
		}
		return errors.Join(append(errs, err)...)
	}
	if err != nil {
		return fmt.Errorf("vmi %s/%s: %w", mig.Namespace, mig.Spec.VMIName, err)
	}
	rec, err := h.readRecord(vmi.UID)
	if err != nil {
		return err
	}
	switch {
	case mig.Status.Phase == v1.MigrationSucceeded:
		// The VMI is bound here now: the handler's own from here on,
		// with the copied volumes given to its claims.
		if rec != nil && rec.Migration == mig.UID {
			return h.adoptTargetVolumes(ctx, mig, rec)
		}
		return nil
	case mig.Status.Phase == v1.MigrationFailed || (st.Failed && vmi.Status.NodeName != h.cfg.NodeName):
		if rec == nil || rec.Migration != mig.UID || vmi.Status.NodeName == h.cfg.NodeName {
			return nil
		}
		log.Info("removing the target of a failed migration")
		return h.removeTarget(ctx, rec)
	case st.TargetNodeAddress != "" || st.Failed || mig.DeletionTimestamp != nil || st.AbortRequested:
		return nil
	}
	if vmi.Status.NodeName == h.cfg.NodeName || vmi.UID == "" {
		return nil
	}
	t0 := time.Now()
	if err := h.prepareTarget(ctx, mig, vmi); err != nil {
		log.Warn("cannot prepare the migration target", "err", err)
		if !permanent(err) && !errors.Is(err, errNotMigratable) {
			return err
		}
		return migstate.UpdateState(ctx, h.cfg.Virt, mig.Namespace, mig.Name, func(_ *v1.VirtualMachineInstanceMigration, s *v1.VirtualMachineInstanceMigrationState) bool {
			now := metav1.Now()
			s.Failed, s.Completed, s.EndTimestamp = true, true, &now
			s.FailureReason = "target node " + h.cfg.NodeName + ": " + err.Error()
			return true
		})
	}
	log.Info("migration target ready", "took", time.Since(t0).Round(time.Millisecond))
	return migstate.UpdateState(ctx, h.cfg.Virt, mig.Namespace, mig.Name, func(_ *v1.VirtualMachineInstanceMigration, s *v1.VirtualMachineInstanceMigrationState) bool {
		if s.TargetNodeAddress != "" {
			return false
		}
		now := metav1.Now()
		s.TargetNodeAddress, s.TargetNodeDomainReadyTimestamp = h.cfg.NodeIP, &now
		return true
	})
}

// errNotMigratable marks a VMI this node cannot receive.
var errNotMigratable = errors.New("not migratable")

// prepareTarget makes what the VMI's guest needs on this node and defines
// its domain (not started): taps on the same bridges with the same MACs,
// the disks, the state directory. Undone on failure.
func (h *Handler) prepareTarget(ctx context.Context, mig *v1.VirtualMachineInstanceMigration, vmi *v1.VirtualMachineInstance) (err error) {
	if h.cfg.NodeIP == "" {
		return fmt.Errorf("%w: this node agent has no node IP", errNotMigratable)
	}
	lv, err := h.manager()
	if err != nil {
		return err
	}
	if ok, why := h.receivable(vmi); !ok {
		return fmt.Errorf("%w: %s", errNotMigratable, why)
	}
	taps, err := h.plannedTaps(ctx, vmi)
	if err != nil {
		return err
	}
	locals, err := h.localClaims(ctx, vmi)
	if err != nil {
		return err
	}
	if len(locals) > 0 && (h.cfg.VolumeMaker == nil || h.cfg.Volumes == nil) {
		return fmt.Errorf("%w: this node agent has no CSI driver to make the volumes of node-local disks", errNotMigratable)
	}
	skip := map[string]bool{}
	for _, l := range locals {
		skip[l.volume] = true
	}
	disks, err := h.resolveDisksExcept(ctx, vmi, skip)
	if err != nil {
		return err
	}
	if err := h.resolveHostDisks(vmi, disks); err != nil {
		return err
	}
	secrets, err := h.resolveSecrets(ctx, vmi)
	if err != nil {
		return err
	}
	configMaps, err := h.resolveConfigMaps(ctx, vmi)
	if err != nil {
		return err
	}
	// The spec is checked against the plan before anything is made here;
	// the node-local disks' volumes are made below, where planned.
	planned := maps.Clone(disks)
	for _, l := range locals {
		planned[l.volume] = domain.DiskSource{Path: filepath.Join(h.vmDir(vmi.UID), "planned", l.volume), Format: VolumeFormat}
	}
	env := domain.Env{Emulation: h.emulation(), StateDir: h.vmDir(vmi.UID), Disks: planned, Taps: plannedDomainTaps(taps), Secrets: secrets,
		ConfigMaps: configMaps}
	if _, err := domain.Convert(vmi, env); err != nil {
		return err
	}
	env.Disks = disks
	rec := &record{UID: vmi.UID, Namespace: vmi.Namespace, Name: vmi.Name, Domain: domain.Name(vmi.Namespace, vmi.Name),
		Taps: taps, Migration: mig.UID}
	if err := h.writeRecord(rec); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			if rerr := h.removeTarget(context.WithoutCancel(ctx), rec); rerr != nil {
				h.log.Warn("undoing the migration target", "vmi", vmi.Namespace+"/"+vmi.Name, "err", rerr)
			}
		}
	}()
	if err := h.makeTargetVolumes(ctx, mig, vmi, locals, rec, disks); err != nil {
		return err
	}
	if env.Taps, err = h.attachTaps(ctx, vmi, taps); err != nil {
		return err
	}
	dom, err := domain.Convert(vmi, env)
	if err != nil {
		return err
	}
	if err := domain.Prepare(ctx, vmi, env); err != nil {
		return err
	}
	return lv.Define(ctx, dom)
}

// localClaim is a VMI volume on a claim bound to a node-local volume: its
// disk is copied by the migration.
type localClaim struct {
	volume, claim string
	pv            *k8sv1.PersistentVolume
}

// localClaims lists the VMI's volumes whose claims are not ReadWriteMany;
// each must be a filesystem volume of the hostpath CSI driver.
func (h *Handler) localClaims(ctx context.Context, vmi *v1.VirtualMachineInstance) ([]localClaim, error) {
	var out []localClaim
	for _, vol := range vmi.Spec.Volumes {
		pvc, err := h.volumeClaim(ctx, vmi, vol)
		if err != nil {
			return nil, err
		}
		if pvc == nil {
			continue
		}
		if slices.Contains(pvc.Spec.AccessModes, k8sv1.ReadWriteMany) {
			continue
		}
		pv, err := h.cfg.Kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("persistentvolume of claim %s/%s: %w", vmi.Namespace, pvc.Name, err)
		}
		if why := copyable(pv); why != "" {
			return nil, fmt.Errorf("%w: claim %s: %s", errNotMigratable, pvc.Name, why)
		}
		out = append(out, localClaim{volume: vol.Name, claim: pvc.Name, pv: pv})
	}
	return out, nil
}

// copyable says why a node-local volume's disk cannot be copied by a
// migration, "" when it can.
func copyable(pv *k8sv1.PersistentVolume) string {
	switch {
	case pv.Spec.CSI == nil || pv.Spec.CSI.Driver != hostpath.DriverName:
		return "only volumes of the " + hostpath.DriverName + " CSI driver are copied"
	case pv.Spec.VolumeMode != nil && *pv.Spec.VolumeMode == k8sv1.PersistentVolumeBlock:
		return "block volumes are not copied by nodevirt yet"
	}
	return ""
}

// makeTargetVolumes makes a volume of this node's CSI driver for each
// node-local disk, with an empty (sparse) disk of the source disk's exact
// virtual size, read from the source node's libvirtd; each is recorded in
// rec before anything else is done with it.
func (h *Handler) makeTargetVolumes(ctx context.Context, mig *v1.VirtualMachineInstanceMigration, vmi *v1.VirtualMachineInstance,
	locals []localClaim, rec *record, disks map[string]domain.DiskSource) error {
	if len(locals) == 0 {
		return nil
	}
	srcIP, err := h.nodeInternalIP(ctx, mig.Status.MigrationState.SourceNode)
	if err != nil {
		return err
	}
	sizes, err := launcher.RemoteDiskCapacities(h.migrationURI(srcIP), domain.Name(vmi.Namespace, vmi.Name))
	if err != nil {
		return fmt.Errorf("disk sizes on the source node: %w", err)
	}
	for _, l := range locals {
		size := sizes["ua-"+l.volume]
		if size == 0 {
			return fmt.Errorf("volume %s: the source domain has no such disk", l.volume)
		}
		params := map[string]string{}
		if p := l.pv.Spec.CSI.VolumeAttributes[hostpath.ParamStoragePool]; p != "" {
			params[hostpath.ParamStoragePool] = p
		}
		topo := []*csispec.Topology{{Segments: map[string]string{hostpath.TopologyKey: h.cfg.NodeName}}}
		resp, err := h.cfg.VolumeMaker.CreateVolume(ctx, &csispec.CreateVolumeRequest{
			Name:          migstate.TargetVolumeName(mig.UID, l.volume),
			CapacityRange: &csispec.CapacityRange{RequiredBytes: l.pv.Spec.Capacity.Storage().Value()},
			VolumeCapabilities: []*csispec.VolumeCapability{{
				AccessMode: &csispec.VolumeCapability_AccessMode{Mode: csispec.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
				AccessType: &csispec.VolumeCapability_Mount{Mount: &csispec.VolumeCapability_MountVolume{}},
			}},
			Parameters:                params,
			AccessibilityRequirements: &csispec.TopologyRequirement{Requisite: topo, Preferred: topo},
		})
		if err != nil {
			return fmt.Errorf("volume %s: create the target volume: %w", l.volume, err)
		}
		id := resp.GetVolume().GetVolumeId()
		rec.MigrationVolumes = append(rec.MigrationVolumes, migrationVolume{Volume: l.volume, Claim: l.claim, VolumeID: id,
			Context: resp.GetVolume().GetVolumeContext()})
		if err := h.writeRecord(rec); err != nil {
			return err
		}
		path, _, err := h.cfg.Volumes.VolumeDisk(id)
		if err != nil {
			return fmt.Errorf("volume %s: %w", l.volume, err)
		}
		if err := sparseFile(path, int64(size)); err != nil {
			return fmt.Errorf("volume %s: %w", l.volume, err)
		}
		disks[l.volume] = domain.DiskSource{Path: path, Format: VolumeFormat}
		h.log.Info("migration target volume made", "vmi", vmi.Namespace+"/"+vmi.Name, "volume", l.volume, "volumeID", id, "bytes", size)
	}
	return nil
}

// sparseFile makes path an empty file of size bytes (a hole).
func sparseFile(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// nodeInternalIP is the InternalIP of node.
func (h *Handler) nodeInternalIP(ctx context.Context, node string) (string, error) {
	n, err := h.cfg.Kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("node %s: %w", node, err)
	}
	for _, a := range n.Status.Addresses {
		if a.Type == k8sv1.NodeInternalIP {
			return a.Address, nil
		}
	}
	return "", fmt.Errorf("node %s has no InternalIP", node)
}

// adoptTargetVolumes gives the volumes made for a successful migration to
// their claims: a PersistentVolume each, pinned to this node and pre-bound
// to the claim's name (the brain replaces the claim). The volumes then
// belong to the PVs: the record forgets them.
func (h *Handler) adoptTargetVolumes(ctx context.Context, mig *v1.VirtualMachineInstanceMigration, rec *record) error {
	for _, mv := range rec.MigrationVolumes {
		pvc, err := h.cfg.Kube.CoreV1().PersistentVolumeClaims(rec.Namespace).Get(ctx, mv.Claim, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("persistentvolumeclaim %s/%s: %w", rec.Namespace, mv.Claim, err)
		}
		name := migstate.TargetVolumeName(mig.UID, mv.Volume)
		if pvc.Spec.VolumeName == name {
			continue
		}
		old, err := h.cfg.Kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("persistentvolume of claim %s/%s: %w", rec.Namespace, mv.Claim, err)
		}
		pv := &k8sv1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: old.Labels, Annotations: old.Annotations, Finalizers: old.Finalizers},
			Spec:       *old.Spec.DeepCopy(),
		}
		pv.Spec.ClaimRef = &k8sv1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: rec.Namespace, Name: mv.Claim}
		pv.Spec.CSI.VolumeHandle, pv.Spec.CSI.VolumeAttributes = mv.VolumeID, mv.Context
		pv.Spec.NodeAffinity = &k8sv1.VolumeNodeAffinity{Required: &k8sv1.NodeSelector{NodeSelectorTerms: []k8sv1.NodeSelectorTerm{{
			MatchExpressions: []k8sv1.NodeSelectorRequirement{{Key: hostpath.TopologyKey, Operator: k8sv1.NodeSelectorOpIn,
				Values: []string{h.cfg.NodeName}}}}}}}
		if _, err := h.cfg.Kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("persistentvolume %s: %w", name, err)
		}
		h.log.Info("migrated volume's persistentvolume made", "vmi", rec.Namespace+"/"+rec.Name, "claim", mv.Claim, "pv", name)
	}
	rec.Migration, rec.MigrationVolumes = "", nil
	return h.writeRecord(rec)
}

// deleteTargetVolumes deletes the volumes made for a failed migration.
func (h *Handler) deleteTargetVolumes(ctx context.Context, rec *record) error {
	if len(rec.MigrationVolumes) == 0 || h.cfg.VolumeMaker == nil {
		return nil
	}
	for _, mv := range rec.MigrationVolumes {
		if _, err := h.cfg.VolumeMaker.DeleteVolume(ctx, &csispec.DeleteVolumeRequest{VolumeId: mv.VolumeID}); err != nil {
			return fmt.Errorf("delete the target volume of %s: %w", mv.Volume, err)
		}
	}
	rec.MigrationVolumes = nil
	return h.writeRecord(rec)
}

// receivable says whether this node can receive vmi by live migration.
func (h *Handler) receivable(vmi *v1.VirtualMachineInstance) (bool, string) {
	for _, n := range vmi.Spec.Networks {
		if n.Pod != nil {
			return false, "pod network interfaces are not migrated by nodevirt yet"
		}
	}
	for _, vol := range vmi.Spec.Volumes {
		switch {
		case vol.ContainerDisk != nil:
			return false, "containerDisk volume " + vol.Name + " is not migrated by nodevirt yet"
		case vol.HostDisk != nil && (vol.HostDisk.Shared == nil || !*vol.HostDisk.Shared):
			return false, "hostDisk volume " + vol.Name + " is not shared"
		}
	}
	return true, ""
}

// removeTarget undoes prepareTarget: the domain (never one that runs the
// VMI bound here), taps and state.
func (h *Handler) removeTarget(ctx context.Context, rec *record) error {
	lv, err := h.manager()
	if err != nil {
		return err
	}
	// The domain first: its disks are in the volumes.
	if err := lv.Undefine(ctx, rec.Domain); err != nil {
		return err
	}
	if err := h.deleteTargetVolumes(ctx, rec); err != nil {
		return err
	}
	return h.cleanup(ctx, lv, rec.UID, rec.Domain)
}

// sweepTargets removes the preparations of migrations that are gone while
// their VMI is not bound here.
func (h *Handler) sweepTargets(ctx context.Context) error {
	recs, err := h.records()
	var errs []error
	for _, r := range recs {
		if r.Migration == "" || h.migrationExists(r.Migration) {
			continue
		}
		if obj, ok, _ := h.vmis.GetIndexer().GetByKey(r.Namespace + "/" + r.Name); ok &&
			obj.(*v1.VirtualMachineInstance).UID == r.UID {
			// The VMI was bound here: the migration succeeded.
			r.Migration = ""
			errs = append(errs, h.writeRecord(r))
			continue
		}
		h.log.Info("removing the target of a deleted migration", "vmi", r.Namespace+"/"+r.Name)
		errs = append(errs, h.removeTarget(ctx, r))
	}
	return errors.Join(append(errs, err)...)
}

func (h *Handler) migrationExists(uid types.UID) bool {
	for _, o := range h.migrations.GetStore().List() {
		if o.(*v1.VirtualMachineInstanceMigration).UID == uid {
			return true
		}
	}
	return false
}

// volumeClaim reads the claim behind vol (a persistentVolumeClaim or a
// dataVolume volume); nil for any other kind of volume.
func (h *Handler) volumeClaim(ctx context.Context, vmi *v1.VirtualMachineInstance, vol v1.Volume) (*k8sv1.PersistentVolumeClaim, error) {
	var claim string
	switch {
	case vol.PersistentVolumeClaim != nil:
		claim = vol.PersistentVolumeClaim.ClaimName
	case vol.DataVolume != nil:
		claim = vol.DataVolume.Name
	default:
		return nil, nil
	}
	pvc, err := h.cfg.Kube.CoreV1().PersistentVolumeClaims(vmi.Namespace).Get(ctx, claim, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("persistentvolumeclaim %s/%s: %w", vmi.Namespace, claim, err)
	}
	return pvc, nil
}
