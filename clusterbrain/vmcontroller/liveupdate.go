package vmcontroller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/hotplug"
)

// Live updates: what a running VM's spec.template may change without a
// restart, as KubeVirt's virt-controller decides it. Hotpluggable volumes
// (and their disks) are plugged into and out of the running VMI when
// declarative hotplug is on (rollout.Cluster); any other template change
// sets the VM's RestartRequired condition, cleared when the VM starts
// again.
//
// The VMI records, in AnnStartSpec, a digest of the part of its VM the
// VMI was started from that only a restart can change (template spec less
// its hotpluggable volumes and their disks and its CPU sockets, instance
// type and preference), so the controller compares digests and needs no
// copy of the old spec. The CPU sockets the VMI runs with are its own
// spec's (cpuhotplug.go).

// AnnStartSpec is the VMI annotation holding the digest of its VM's
// restart-only settings when the VMI was created.
const AnnStartSpec = "nodevirt.io/vm-start-spec"

// annVMGeneration is KubeVirt's VMI annotation naming the generation of
// the VM it was created from.
const annVMGeneration = "kubevirt.io/vm-generation"

// msgRestartRequired is KubeVirt's RestartRequired message for a
// template change that is not live-updatable.
const msgRestartRequired = "a non-live-updatable field was changed in the template spec"

// hotplugRetry is how often a declared volume that could not be placed
// yet (its claim is missing or unbound) is tried again.
const hotplugRetry = 10 * time.Second

// digestVersion prefixes the digests that leave the CPU sockets out; a
// VMI started before carries a bare digest of the spec with them.
const digestVersion = "2."

// startDigest digests what only a restart of vm can apply.
func startDigest(vm *kubevirtv1.VirtualMachine) string {
	spec := vm.Spec.Template.Spec.DeepCopy()
	if spec.Domain.CPU != nil {
		spec.Domain.CPU.Sockets = 0
	}
	return digestVersion + specDigest(vm, spec)
}

// startChanged reports whether vm's restart-only part differs from the
// one digest was taken of.
func startChanged(vm *kubevirtv1.VirtualMachine, digest string) bool {
	if !strings.HasPrefix(digest, digestVersion) {
		return digest != specDigest(vm, vm.Spec.Template.Spec.DeepCopy())
	}
	return digest != startDigest(vm)
}

// specDigest digests spec (vm's template spec, which it changes) less its
// hotpluggable volumes and their disks, with vm's instance type and
// preference.
func specDigest(vm *kubevirtv1.VirtualMachine, spec *kubevirtv1.VirtualMachineInstanceSpec) string {
	var hot []string
	spec.Volumes = slices.DeleteFunc(spec.Volumes, func(v kubevirtv1.Volume) bool {
		if hotplug.Hotpluggable(v) {
			hot = append(hot, v.Name)
			return true
		}
		return false
	})
	spec.Domain.Devices.Disks = slices.DeleteFunc(spec.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool { return slices.Contains(hot, d.Name) })
	data, _ := json.Marshal(struct {
		Spec         *kubevirtv1.VirtualMachineInstanceSpec `json:"spec"`
		Instancetype *kubevirtv1.InstancetypeMatcher        `json:"instancetype,omitempty"`
		Preference   *kubevirtv1.PreferenceMatcher          `json:"preference,omitempty"`
	}{spec, vm.Spec.Instancetype, vm.Spec.Preference})
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:16])
}

// liveUpdate carries the template of st's running VM to its VMI where it
// can, and records in st what needs a restart. It returns when to look
// again (0: on the next change).
func (c *Controller) liveUpdate(ctx context.Context, st *state) (time.Duration, error) {
	vm, vmi := st.vm, st.vmi
	if vmi == nil || st.deleted || st.created || vmi.DeletionTimestamp != nil || vmi.IsFinal() {
		return 0, nil
	}
	var why []string
	if d, ok := vmi.Annotations[AnnStartSpec]; ok {
		st.restartKnown = true
		// The generation the VMI was created from: no spec change since.
		if vmi.Annotations[annVMGeneration] != fmt.Sprint(vm.Generation) && startChanged(vm, d) {
			why = append(why, msgRestartRequired)
		}
	}
	cfg := c.cfg.Rollout.Get()
	// A VM that restarts anyway gets its new CPUs then (as KubeVirt, which
	// live-updates nothing once a restart is required).
	if len(why) == 0 && !migrating(vmi) {
		msg, err := c.liveCPU(ctx, cfg, vm, vmi)
		if err != nil {
			return 0, err
		}
		if msg != "" {
			st.restartKnown = true
			why = append(why, msg)
		}
	}
	var after time.Duration
	var err error
	if cfg.DeclarativeHotplug && vmi.IsRunning() && !migrating(vmi) {
		var notLive []string
		notLive, after, err = c.declareVolumes(ctx, vm, vmi)
		if len(notLive) > 0 {
			st.restartKnown = true
			why = append(why, notLive...)
		}
	}
	st.restartRequired = strings.Join(why, "; ")
	return after, err
}

func migrating(vmi *kubevirtv1.VirtualMachineInstance) bool {
	m := vmi.Status.MigrationState
	return m != nil && !m.Completed && !m.Failed
}

// declareVolumes plugs the hotpluggable volumes vm's template gained into
// vmi and unplugs those it lost, by patching the VMI's spec (the node agent
// does the rest, as for the addvolume subresource). It returns why
// declared volumes cannot be plugged live, and when to try again for
// volumes whose claim is not ready.
func (c *Controller) declareVolumes(ctx context.Context, vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) ([]string, time.Duration, error) {
	plan := hotplug.Declare(&vm.Spec.Template.Spec, vmi)
	notLive := plan.NotLive
	if plan.Spec == nil {
		return notLive, 0, nil
	}
	var after time.Duration
	var refused []string
	for _, v := range plan.Add {
		err := hotplug.Place(ctx, c.cfg.Kube, vmi, v, false)
		var r *hotplug.Refusal
		switch {
		case errors.As(err, &r):
			c.recorder.Eventf(vm, corev1.EventTypeWarning, "FailedHotplugVolume", "%v", r)
			refused, after = append(refused, v.Name), hotplugRetry
		case err != nil:
			return notLive, 0, fmt.Errorf("hotplug volume %s: %w", v.Name, err)
		}
	}
	spec := plan.Spec
	spec.Volumes = slices.DeleteFunc(spec.Volumes, func(v kubevirtv1.Volume) bool { return slices.Contains(refused, v.Name) })
	spec.Domain.Devices.Disks = slices.DeleteFunc(spec.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool {
		return slices.Contains(refused, d.Name) && !slices.ContainsFunc(vmi.Spec.Domain.Devices.Disks, func(o kubevirtv1.Disk) bool { return o.Name == d.Name })
	})
	if len(refused) == len(plan.Add) && len(plan.Remove) == 0 {
		return notLive, after, nil
	}
	data, err := volumesPatch(&vmi.Spec, spec)
	if err != nil {
		return notLive, 0, err
	}
	if _, err := c.cfg.Virt.VMIs.Patch(ctx, vmi.Namespace, vmi.Name, types.JSONPatchType, data, metav1.PatchOptions{}); err != nil {
		// A failed test means the VMI changed meanwhile: its update
		// brings us back.
		return notLive, 0, fmt.Errorf("patch vmi volumes: %w", err)
	}
	for _, v := range plan.Add {
		if !slices.Contains(refused, v.Name) {
			c.recorder.Eventf(vm, corev1.EventTypeNormal, "VolumeHotplugged", "Added volume %s to the running VMI", v.Name)
		}
	}
	for _, n := range plan.Remove {
		c.recorder.Eventf(vm, corev1.EventTypeNormal, "VolumeUnplugged", "Removed volume %s from the running VMI", n)
	}
	return notLive, after, nil
}

// volumesPatch replaces the VMI's volumes and disks, testing that they
// are still those the change was computed from.
func volumesPatch(old, cur *kubevirtv1.VirtualMachineInstanceSpec) ([]byte, error) {
	type op struct {
		Op    string `json:"op"`
		Path  string `json:"path"`
		Value any    `json:"value"`
	}
	verb := func(n int) string {
		if n > 0 {
			return "replace"
		}
		return "add"
	}
	return json.Marshal([]op{
		{"test", "/spec/volumes", old.Volumes},
		{"test", "/spec/domain/devices/disks", old.Domain.Devices.Disks},
		{verb(len(old.Volumes)), "/spec/volumes", cur.Volumes},
		{verb(len(old.Domain.Devices.Disks)), "/spec/domain/devices/disks", cur.Domain.Devices.Disks},
	})
}

// restartCondition sets or clears the VM's RestartRequired condition from
// st: cleared by a start, set while the running VMI lags behind its VM.
func restartCondition(conds []kubevirtv1.VirtualMachineCondition, st *state, now metav1.Time) []kubevirtv1.VirtualMachineCondition {
	switch {
	case st.created || (st.restartKnown && st.restartRequired == ""):
		return removeCondition(conds, kubevirtv1.VirtualMachineRestartRequired)
	case st.restartKnown:
		return setCondition(conds, kubevirtv1.VirtualMachineCondition{Type: kubevirtv1.VirtualMachineRestartRequired,
			Status: corev1.ConditionTrue, Message: st.restartRequired, LastTransitionTime: now})
	}
	return conds
}
