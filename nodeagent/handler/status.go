package handler

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher"
)

// Reasons in status.reason of a failed VMI.
const (
	ReasonQEMUCrashed = "QEMUCrashed"
	ReasonGuestPanic  = "GuestPanicked"
	ReasonDestroyed   = "DomainDestroyed"
	ReasonDomainLost  = "DomainLost"
	ReasonStopped     = "DomainStopped"
)

// observe writes the VMI's status from its domain: found false means the
// domain does not exist (any more).
func (h *Handler) observe(ctx context.Context, lv *launcher.Manager, vmi *v1.VirtualMachineInstance, info launcher.DomainInfo, found bool) error {
	out := vmi.DeepCopy()
	out.Status.NodeName = h.cfg.NodeName
	removeCondition(out, v1.VirtualMachineInstanceSynchronized)
	var hotplugErr error
	if out.Annotations == nil {
		out.Annotations = map[string]string{}
	}
	switch {
	case found && info.State.Active():
		setPhase(out, v1.Running)
		out.Status.Reason = ""
		if info.PID > 0 {
			out.Annotations[AnnotationQEMUPID] = strconv.Itoa(info.PID)
		}
		xml, err := lv.DomainXML(ctx, info.Name)
		if err != nil {
			return err
		}
		out.Annotations[AnnotationEmulation] = strconv.FormatBool(xml.Type == "qemu")
		if err := h.readoptPodTaps(ctx, vmi); err != nil {
			// The guest keeps running on its tap; the next reconcile
			// tries again.
			h.log.Warn("pod network", "vmi", vmi.Namespace+"/"+vmi.Name, "err", err)
		}
		agentIfs := h.observeAgent(ctx, lv, vmi, out, info, xml)
		out.Status.Interfaces = interfaceStatus(vmi, xml.Devices, h.podLeases, agentIfs)
		if info.State == launcher.StatePaused {
			reason := "PausedByUser"
			if info.Reason == "ioerror" {
				reason = "PausedIOError"
			}
			setCondition(out, v1.VirtualMachineInstancePaused, true, reason, "VMI was paused ("+info.Reason+")")
			setCondition(out, v1.VirtualMachineInstanceReady, false, "Paused", "the guest's vCPUs are paused")
		} else {
			removeCondition(out, v1.VirtualMachineInstancePaused)
			setCondition(out, v1.VirtualMachineInstanceReady, true, "", "")
		}
		hotplugErr = errors.Join(h.syncHotplug(ctx, lv, vmi, out, xml), h.syncVCPUs(ctx, lv, vmi, out, xml))
		switch c := conditionOf(out, v1.VirtualMachineInstanceIsMigratable); {
		case hasHotplug(out):
			// The target would have to resolve and attach the same
			// volumes: not done yet, so refused as such.
			setCondition(out, v1.VirtualMachineInstanceIsMigratable, false, v1.VirtualMachineInstanceReasonHotplugNotMigratable,
				"nodevirt does not migrate VMIs with hotplugged volumes yet")
		case c == nil || c.Reason == v1.VirtualMachineInstanceReasonHotplugNotMigratable:
			ok, reason, msg, err := h.migratable(ctx, vmi)
			if err != nil {
				return err
			}
			setCondition(out, v1.VirtualMachineInstanceIsMigratable, ok, reason, msg)
		}
	default:
		phase, reason, msg := h.stoppedPhase(vmi, info, found)
		setPhase(out, phase)
		out.Status.Reason = reason
		delete(out.Annotations, AnnotationQEMUPID)
		removeCondition(out, v1.VirtualMachineInstancePaused)
		removeCondition(out, v1.VirtualMachineInstanceAgentConnected)
		h.forgetAgent(vmi)
		setCondition(out, v1.VirtualMachineInstanceReady, false, v1.GuestNotRunningReason, msg)
		if phase == v1.Failed {
			h.log.Warn("vmi failed", "vmi", vmi.Namespace+"/"+vmi.Name, "reason", reason, "message", msg)
		}
	}
	if _, err := h.write(ctx, vmi, out); err != nil {
		return err
	}
	return hotplugErr
}

// stoppedPhase is the final phase of a VMI whose domain is not active.
func (h *Handler) stoppedPhase(vmi *v1.VirtualMachineInstance, info launcher.DomainInfo, found bool) (v1.VirtualMachineInstancePhase, string, string) {
	requested := vmi.DeletionTimestamp != nil || h.isStopping(vmi.UID)
	switch {
	case !found && requested:
		return v1.Succeeded, "", "the domain is gone"
	case !found:
		return v1.Failed, ReasonDomainLost, "the libvirt domain disappeared"
	case info.State == launcher.StateCrashed:
		return v1.Failed, ReasonGuestPanic, "the guest crashed (" + info.Reason + ")"
	case info.Reason == "shutdown":
		return v1.Succeeded, "", "the guest powered off"
	case info.Reason == "destroyed" && requested:
		return v1.Succeeded, "", "the guest was stopped"
	case info.Reason == "destroyed":
		return v1.Failed, ReasonDestroyed, "the domain was destroyed outside nodevirt"
	case info.Reason == "crashed" || info.Reason == "failed":
		return v1.Failed, ReasonQEMUCrashed, "the QEMU process exited unexpectedly (" + info.Reason + ")"
	}
	return v1.Failed, ReasonStopped, "the domain stopped (" + info.Reason + ")"
}

// interfaceStatus lists the VMI's interfaces with the MACs the domain uses
// and, for pod network interfaces, the address leases (interface name →
// address, given the interface MACs) returns. agent is what the guest agent
// reports now: nil when it was not asked this time (what it said before is
// kept), empty when there is no agent (its addresses go). An interface
// whose MAC the agent reports gets the guest's name for it and its
// addresses; a pod network lease stays the primary address.
func interfaceStatus(vmi *v1.VirtualMachineInstance, devs *libvirtxml.DomainDeviceList,
	leases func(*v1.VirtualMachineInstance, map[string]string) map[string]net.IP,
	agent []launcher.GuestInterface) []v1.VirtualMachineInstanceNetworkInterface {
	domMACs := map[string]string{}
	if devs != nil {
		for _, i := range devs.Interfaces {
			if i.Alias != nil && i.MAC != nil {
				domMACs[i.Alias.Name] = i.MAC.Address
			}
		}
	}
	macs := map[string]string{}
	for _, iface := range vmi.Spec.Domain.Devices.Interfaces {
		if iface.State == v1.InterfaceStateAbsent {
			continue
		}
		mac := iface.MacAddress
		if mac == "" {
			mac = domMACs["ua-"+iface.Name]
		}
		macs[iface.Name] = mac
	}
	var leased map[string]net.IP
	if leases != nil {
		leased = leases(vmi, macs)
	}
	var out []v1.VirtualMachineInstanceNetworkInterface
	for _, iface := range vmi.Spec.Domain.Devices.Interfaces {
		if iface.State == v1.InterfaceStateAbsent {
			continue
		}
		mac := macs[iface.Name]
		st := v1.VirtualMachineInstanceNetworkInterface{Name: iface.Name, MAC: mac, InfoSource: "domain"}
		switch {
		case agent == nil:
			// Keep what the agent said when it was last asked.
			for _, old := range vmi.Status.Interfaces {
				if old.Name == iface.Name && strings.EqualFold(old.MAC, mac) {
					st.IP, st.IPs, st.InterfaceName, st.InfoSource = old.IP, old.IPs, old.InterfaceName, old.InfoSource
				}
			}
		default:
			for _, gi := range agent {
				if mac != "" && strings.EqualFold(gi.MAC, mac) {
					st.InterfaceName, st.InfoSource = gi.Name, "domain, guest-agent"
					st.IP, st.IPs = gi.IP, gi.IPs
				}
			}
		}
		if ip := leased[iface.Name]; ip != nil {
			// The pod network's DHCP server hands the guest this address.
			st.IP = ip.String()
			st.IPs = append([]string{st.IP}, slices.DeleteFunc(slices.Clone(st.IPs), func(s string) bool { return s == st.IP })...)
		}
		out = append(out, st)
	}
	return out
}

// migratable applies KubeVirt's rules (a hostDisk shared, no bridge
// binding on the pod network; a PVC ReadWriteMany, or here also a
// filesystem volume of the hostpath CSI driver, whose disk the migration
// copies) and says what nodevirt does not move yet (pod network
// interfaces, containerDisks, other node-local volumes).
func (h *Handler) migratable(ctx context.Context, vmi *v1.VirtualMachineInstance) (bool, string, string, error) {
	pod := map[string]bool{}
	for _, n := range vmi.Spec.Networks {
		pod[n.Name] = n.Pod != nil
	}
	for _, iface := range vmi.Spec.Domain.Devices.Interfaces {
		if iface.Bridge != nil && pod[iface.Name] {
			return false, v1.VirtualMachineInstanceReasonInterfaceNotMigratable,
				"cannot migrate VMI which uses the bridge binding on the pod network", nil
		}
		if pod[iface.Name] {
			return false, v1.VirtualMachineInstanceReasonInterfaceNotMigratable,
				"nodevirt does not migrate interfaces on the pod network yet", nil
		}
	}
	for _, vol := range vmi.Spec.Volumes {
		switch {
		case vol.HostDisk != nil && (vol.HostDisk.Shared == nil || !*vol.HostDisk.Shared):
			return false, v1.VirtualMachineInstanceReasonDisksNotMigratable, "cannot migrate VMI with non-shared HostDisk", nil
		case vol.ContainerDisk != nil:
			return false, v1.VirtualMachineInstanceReasonDisksNotMigratable,
				"nodevirt does not migrate containerDisk volumes yet (" + vol.Name + ")", nil
		}
	}
	for _, vol := range vmi.Spec.Volumes {
		pvc, err := h.volumeClaim(ctx, vmi, vol)
		if err != nil {
			return false, "", "", err
		}
		if pvc == nil {
			continue
		}
		if slices.Contains(pvc.Spec.AccessModes, k8sv1.ReadWriteMany) {
			continue
		}
		// A node-local volume of the hostpath CSI driver is copied to the
		// target node by the migration (KubeVirt would refuse it).
		pv, err := h.cfg.Kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return false, "", "", fmt.Errorf("persistentvolume of claim %s/%s: %w", vmi.Namespace, pvc.Name, err)
		}
		if copyable(pv) != "" {
			return false, v1.VirtualMachineInstanceReasonDisksNotMigratable,
				fmt.Sprintf("cannot migrate VMI: PVC %s is not shared, live migration requires that all PVCs must be shared (using ReadWriteMany access mode)", pvc.Name), nil
		}
	}
	return true, "", "", nil
}

func setPhase(vmi *v1.VirtualMachineInstance, phase v1.VirtualMachineInstancePhase) {
	if vmi.Status.Phase == phase {
		return
	}
	vmi.Status.Phase = phase
	vmi.Status.PhaseTransitionTimestamps = append(vmi.Status.PhaseTransitionTimestamps,
		v1.VirtualMachineInstancePhaseTransitionTimestamp{Phase: phase, PhaseTransitionTimestamp: metav1.Now()})
}

func conditionOf(vmi *v1.VirtualMachineInstance, t v1.VirtualMachineInstanceConditionType) *v1.VirtualMachineInstanceCondition {
	for i := range vmi.Status.Conditions {
		if vmi.Status.Conditions[i].Type == t {
			return &vmi.Status.Conditions[i]
		}
	}
	return nil
}

// setCondition sets a condition, keeping its transition time when its
// status does not change.
func setCondition(vmi *v1.VirtualMachineInstance, t v1.VirtualMachineInstanceConditionType, ok bool, reason, msg string) {
	status := k8sv1.ConditionFalse
	if ok {
		status = k8sv1.ConditionTrue
	}
	c := conditionOf(vmi, t)
	if c == nil {
		vmi.Status.Conditions = append(vmi.Status.Conditions, v1.VirtualMachineInstanceCondition{Type: t})
		c = &vmi.Status.Conditions[len(vmi.Status.Conditions)-1]
	}
	if c.Status != status {
		c.LastTransitionTime = metav1.Now()
	}
	c.Status, c.Reason, c.Message = status, reason, msg
}

func removeCondition(vmi *v1.VirtualMachineInstance, t v1.VirtualMachineInstanceConditionType) {
	vmi.Status.Conditions = slices.DeleteFunc(vmi.Status.Conditions, func(c v1.VirtualMachineInstanceCondition) bool {
		return c.Type == t
	})
}

// ensureFinalizer adds Finalizer before anything is made for the VMI.
func (h *Handler) ensureFinalizer(ctx context.Context, vmi *v1.VirtualMachineInstance) (*v1.VirtualMachineInstance, error) {
	if slices.Contains(vmi.Finalizers, Finalizer) {
		return vmi, nil
	}
	out := vmi.DeepCopy()
	out.Finalizers = append(out.Finalizers, Finalizer)
	return h.write(ctx, vmi, out)
}

// write stores what changed from old to out: metadata (finalizers,
// annotations) through an update, status through the status subresource.
// Nothing changed, nothing is written. A conflict is returned, and the
// reconcile runs again on the newer object.
func (h *Handler) write(ctx context.Context, old, out *v1.VirtualMachineInstance) (*v1.VirtualMachineInstance, error) {
	cur := old
	if !slices.Equal(old.Finalizers, out.Finalizers) || !maps.Equal(old.Annotations, out.Annotations) {
		upd := old.DeepCopy()
		upd.Finalizers, upd.Annotations = out.Finalizers, out.Annotations
		got, err := h.cfg.Virt.VMIs.Update(ctx, upd)
		if apierrors.IsNotFound(err) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("update vmi %s/%s: %w", old.Namespace, old.Name, err)
		}
		cur = got
	}
	if equality.Semantic.DeepEqual(old.Status, out.Status) {
		return cur, nil
	}
	upd := cur.DeepCopy()
	upd.Status = out.Status
	got, err := h.cfg.Virt.VMIs.UpdateStatus(ctx, upd)
	if apierrors.IsNotFound(err) {
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("update status of vmi %s/%s: %w", old.Namespace, old.Name, err)
	}
	return got, nil
}
