package subresources

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/hotplug"
)

// Volume hotplug, as virt-api serves it. With KubeVirt's HotplugVolumes
// gate (or neither gate): addvolume and removevolume on a VMI change the
// running VMI only (virtctl addvolume); on a VM (virtctl addvolume
// --persist) they change spec.template and, when the VM runs, its VMI as
// well. With DeclarativeHotplugVolumes (rollout.Cluster): a VMI a VM owns
// takes no ephemeral volume (400), and a VM's addvolume changes its
// template only, which the VM controller carries to the VMI. The node agent
// running the VMI attaches and detaches the disks (SCSI, KubeVirt's
// default bus) and reports them in status.volumeStatus. A dry run checks
// everything and changes nothing.

// hotplugBus is the one bus hotplugged disks may use here.
const hotplugBus = hotplug.Bus

// volumeRequest is one addvolume or removevolume request.
type volumeRequest struct {
	add    *kubevirtv1.AddVolumeOptions
	remove *kubevirtv1.RemoveVolumeOptions
}

func (v volumeRequest) dryRun() []string {
	var d []string
	if v.add != nil {
		d = v.add.DryRun
	} else {
		d = v.remove.DryRun
	}
	if isDryRun(d) {
		return d
	}
	return nil
}

// decodeAddVolume reads and checks an AddVolumeOptions body, with
// virt-api's messages.
func decodeAddVolume(r *http.Request) (volumeRequest, error) {
	opts := &kubevirtv1.AddVolumeOptions{}
	if err := decodeBody(r, opts); err != nil {
		return volumeRequest{}, err
	}
	switch {
	case opts.Name == "":
		return volumeRequest{}, apierrors.NewBadRequest("AddVolumeOptions requires name to be set")
	case opts.Disk == nil:
		return volumeRequest{}, apierrors.NewBadRequest("AddVolumeOptions requires disk to not be nil")
	case opts.VolumeSource == nil || (opts.VolumeSource.DataVolume == nil && opts.VolumeSource.PersistentVolumeClaim == nil):
		return volumeRequest{}, apierrors.NewBadRequest("AddVolumeOptions requires VolumeSource to not be nil")
	}
	opts.Disk.Name = opts.Name
	if opts.Disk.Disk == nil && opts.Disk.LUN == nil && opts.Disk.CDRom == nil {
		opts.Disk.Disk = &kubevirtv1.DiskTarget{Bus: hotplugBus}
	}
	switch d := opts.Disk.DiskDevice; {
	case d.CDRom != nil:
		return volumeRequest{}, apierrors.NewBadRequest("a hotplugged volume must be a disk or a lun, not a cdrom")
	case d.Disk != nil && d.Disk.Bus == "":
		d.Disk.Bus = hotplugBus
	case d.Disk != nil && d.Disk.Bus != hotplugBus:
		return volumeRequest{}, apierrors.NewBadRequest(fmt.Sprintf("nodevirt hotplugs disks on the %s bus only, not %q", hotplugBus, d.Disk.Bus))
	}
	if opts.Disk.BootOrder != nil {
		return volumeRequest{}, apierrors.NewBadRequest("a hotplugged disk cannot have a boot order")
	}
	if dv := opts.VolumeSource.DataVolume; dv != nil {
		dv.Hotpluggable = true
	} else {
		opts.VolumeSource.PersistentVolumeClaim.Hotpluggable = true
	}
	return volumeRequest{add: opts}, nil
}

func decodeRemoveVolume(r *http.Request) (volumeRequest, error) {
	opts := &kubevirtv1.RemoveVolumeOptions{}
	if err := decodeBody(r, opts); err != nil {
		return volumeRequest{}, err
	}
	if opts.Name == "" {
		return volumeRequest{}, apierrors.NewBadRequest("RemoveVolumeOptions requires name to be set")
	}
	return volumeRequest{remove: opts}, nil
}

func (v volumeRequest) claim() string {
	if dv := v.add.VolumeSource.DataVolume; dv != nil {
		return dv.Name
	}
	return v.add.VolumeSource.PersistentVolumeClaim.ClaimName
}

// apply returns spec with the request applied, or why it cannot be: an
// added volume whose name or source is taken, a removed volume that does
// not exist or was not hotplugged (virt-api's checks and messages). A
// removal names the volume or its source.
func (v volumeRequest) apply(spec *kubevirtv1.VirtualMachineInstanceSpec) (*kubevirtv1.VirtualMachineInstanceSpec, error) {
	out := spec.DeepCopy()
	if v.add != nil {
		for _, vol := range spec.Volumes {
			if vol.Name == v.add.Name {
				return nil, fmt.Errorf("Unable to add volume [%s] because volume with that name already exists", v.add.Name)
			}
			if src := hotplug.SourceName(vol); src != "" && src == v.claim() {
				return nil, fmt.Errorf("Unable to add volume source [%s] because it already exists", src)
			}
		}
		vol := kubevirtv1.Volume{Name: v.add.Name}
		if dv := v.add.VolumeSource.DataVolume; dv != nil {
			vol.DataVolume = dv.DeepCopy()
		} else {
			vol.PersistentVolumeClaim = v.add.VolumeSource.PersistentVolumeClaim.DeepCopy()
		}
		out.Volumes = append(out.Volumes, vol)
		out.Domain.Devices.Disks = append(out.Domain.Devices.Disks, *v.add.Disk.DeepCopy())
		return out, nil
	}
	name := v.remove.Name
	i := slices.IndexFunc(spec.Volumes, func(vol kubevirtv1.Volume) bool { return vol.Name == name || hotplug.SourceName(vol) == name })
	if i < 0 {
		return nil, fmt.Errorf("Unable to remove volume [%s] because it does not exist", name)
	}
	if !hotplug.Hotpluggable(spec.Volumes[i]) {
		return nil, fmt.Errorf("Unable to remove volume [%s] because it is not hotpluggable", spec.Volumes[i].Name)
	}
	volName := spec.Volumes[i].Name
	out.Volumes = slices.Delete(out.Volumes, i, i+1)
	out.Domain.Devices.Disks = slices.DeleteFunc(out.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool { return d.Name == volName })
	return out, nil
}

// specPatch replaces the volumes and disks under prefix, testing that
// they are still what the request was checked against.
func specPatch(prefix string, old, cur *kubevirtv1.VirtualMachineInstanceSpec) ([]byte, error) {
	volumes, disks := prefix+"/spec/volumes", prefix+"/spec/domain/devices/disks"
	ops := []any{testOp{"test", volumes, old.Volumes}, testOp{"test", disks, old.Domain.Devices.Disks}}
	verb := func(n int) string {
		if n > 0 {
			return "replace"
		}
		return "add"
	}
	ops = append(ops, patchOp{Op: verb(len(old.Volumes)), Path: volumes, Value: cur.Volumes},
		patchOp{Op: verb(len(old.Domain.Devices.Disks)), Path: disks, Value: cur.Domain.Devices.Disks})
	return json.Marshal(ops)
}

// patchVMIVolumes applies v to the running vmi (after placing an added
// volume on its node).
func (s *Server) patchVMIVolumes(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, v volumeRequest) error {
	if err := hotpluggableNow(vmi); err != nil {
		return err
	}
	spec, err := v.apply(&vmi.Spec)
	if err != nil {
		return apierrors.NewConflict(vmiResource, vmi.Name, err)
	}
	if v.add != nil {
		if err := s.placeClaim(ctx, vmi, v); err != nil {
			return err
		}
	}
	data, err := specPatch("", &vmi.Spec, spec)
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	_, err = s.cfg.Virt.VMIs.Patch(ctx, vmi.Namespace, vmi.Name, types.JSONPatchType, data, metav1.PatchOptions{DryRun: v.dryRun()})
	return patchError(vmi.Name, err)
}

// hotpluggableNow says why vmi cannot take a volume change now: it is
// not running, or it is migrating.
func hotpluggableNow(vmi *kubevirtv1.VirtualMachineInstance) error {
	if !vmi.IsRunning() {
		return apierrors.NewConflict(vmiResource, vmi.Name, errors.New(msgVMINotRunning))
	}
	if m := vmi.Status.MigrationState; m != nil && !m.Completed && !m.Failed {
		return apierrors.NewConflict(vmiResource, vmi.Name, errors.New("a migration of the VMI is in progress: volumes cannot be hotplugged meanwhile"))
	}
	return nil
}

// patchError maps a failed VMI patch: a failed test is a conflict (the
// VMI changed meanwhile).
func patchError(name string, err error) error {
	switch {
	case err == nil:
		return nil
	case strings.Contains(err.Error(), "test operation does not apply") || apierrors.IsConflict(err):
		return apierrors.NewConflict(vmiResource, name, err)
	}
	if _, ok := err.(apierrors.APIStatus); ok {
		return err
	}
	return apierrors.NewInternalError(err)
}

// placeClaim puts the claim of the volume v adds on vmi's node, or says
// why it cannot go there (a 400).
func (s *Server) placeClaim(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, v volumeRequest) error {
	vol := kubevirtv1.Volume{Name: v.add.Name, VolumeSource: kubevirtv1.VolumeSource{
		DataVolume: v.add.VolumeSource.DataVolume, PersistentVolumeClaim: v.add.VolumeSource.PersistentVolumeClaim}}
	err := hotplug.Place(ctx, s.cfg.Kube, vmi, vol, v.dryRun() != nil)
	var refused *hotplug.Refusal
	switch {
	case err == nil:
		return nil
	case errors.As(err, &refused):
		return apierrors.NewBadRequest(refused.Error())
	}
	return apierrors.NewInternalError(err)
}

// volumeVMI serves addvolume (add) or removevolume on a VMI.
func (s *Server) volumeVMI(add bool) handler {
	return func(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
		v, err := decodeVolumeRequest(r, add)
		if err != nil {
			return err
		}
		vmi, err := s.fetchVMI(r.Context(), req.namespace, req.name)
		if err != nil {
			return err
		}
		if metav1.GetControllerOf(vmi) != nil && metav1.GetControllerOf(vmi).Kind == "VirtualMachine" && s.cfg.Rollout.Get().DeclarativeHotplug {
			return apierrors.NewBadRequest(fmt.Sprintf("VMI %s/%s is owned by a VM", vmi.Namespace, vmi.Name))
		}
		if err := s.patchVMIVolumes(r.Context(), vmi, v); err != nil {
			return err
		}
		log.Info("vmi "+req.subresource, "volume", v.name(), "dryRun", v.dryRun() != nil)
		return accepted(w)
	}
}

// volumeVM serves addvolume or removevolume on a VM: its template changes,
// and its running VMI with it.
func (s *Server) volumeVM(add bool) handler {
	return func(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
		ctx := r.Context()
		v, err := decodeVolumeRequest(r, add)
		if err != nil {
			return err
		}
		vm, err := s.getVM(ctx, req.namespace, req.name)
		if err != nil {
			return err
		}
		if vm.Spec.Template == nil {
			return apierrors.NewConflict(vmResource, vm.Name, errors.New("VM has no template"))
		}
		spec, err := v.apply(&vm.Spec.Template.Spec)
		if err != nil {
			return apierrors.NewConflict(vmResource, vm.Name, err)
		}
		vmi, err := s.getVMI(ctx, req.namespace, req.name)
		if err != nil {
			return err
		}
		running := vmi != nil && !vmi.IsFinal() && vmi.DeletionTimestamp == nil && vmi.IsRunning()
		if running {
			// Refused before the template changes.
			if err := hotpluggableNow(vmi); err != nil {
				return err
			}
		}
		if running && v.add != nil {
			if _, err := v.apply(&vmi.Spec); err != nil {
				return apierrors.NewConflict(vmiResource, vmi.Name, err)
			}
			if err := s.placeClaim(ctx, vmi, v); err != nil {
				return err
			}
		}
		data, err := specPatch("/spec/template", &vm.Spec.Template.Spec, spec)
		if err != nil {
			return apierrors.NewInternalError(err)
		}
		if err := s.patchVM(ctx, vm, data, v.dryRun(), false); err != nil {
			return err
		}
		// A volume removed from the template is unplugged from the VMI
		// only if the VMI has it (it may have been added after the start).
		// With declarative hotplug the VM controller does it.
		if running && !s.cfg.Rollout.Get().DeclarativeHotplug {
			if _, notInVMI := v.apply(&vmi.Spec); v.add != nil || notInVMI == nil {
				if err := s.patchVMIVolumes(ctx, vmi, v); err != nil {
					return err
				}
			}
		}
		log.Info("vm "+req.subresource, "volume", v.name(), "running", running, "dryRun", v.dryRun() != nil)
		return accepted(w)
	}
}

func decodeVolumeRequest(r *http.Request, add bool) (volumeRequest, error) {
	if add {
		return decodeAddVolume(r)
	}
	return decodeRemoveVolume(r)
}

func (v volumeRequest) name() string {
	if v.add != nil {
		return v.add.Name
	}
	return v.remove.Name
}
