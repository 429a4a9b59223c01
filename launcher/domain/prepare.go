package domain

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"

	v1 "kubevirt.io/api/core/v1"
)

// Prepare creates the files vmi's domain refers to inside env.StateDir (made
// if missing): qcow2 images of emptyDisk volumes, qcow2 overlays of ephemeral
// volumes on their node disk and of containerDisk volumes on their pulled
// image, and cloud-init seed ISOs. hostDisk images are the node's to find or
// create (inside its allowed root), before Prepare; they come in Env.Disks.
//
// Prepare is idempotent: images that exist are kept (they hold the guest's
// data while the VMI lives); seeds are rebuilt. When it fails, it removes what
// this call created.
func Prepare(ctx context.Context, vmi *v1.VirtualMachineInstance, env Env) (err error) {
	if err := env.validate(); err != nil {
		return fmt.Errorf("prepare %s/%s: %w", vmi.Namespace, vmi.Name, err)
	}
	var created []string
	defer func() {
		if err != nil {
			for i := len(created) - 1; i >= 0; i-- {
				os.Remove(created[i])
			}
			err = fmt.Errorf("prepare %s/%s: %w", vmi.Namespace, vmi.Name, err)
		}
	}()
	if _, statErr := os.Stat(env.StateDir); errors.Is(statErr, fs.ErrNotExist) {
		if err := os.MkdirAll(env.StateDir, 0o755); err != nil {
			return err
		}
		created = append(created, env.StateDir)
	}
	for i := range vmi.Spec.Volumes {
		vol := &vmi.Spec.Volumes[i]
		path := fmt.Sprintf("spec.volumes[%d]", i)
		s := &vol.VolumeSource
		switch {
		case s.EmptyDisk != nil:
			p := env.EmptyDiskPath(vol.Name)
			if exists(p) {
				continue
			}
			if err := qemuImg(ctx, "create", "-q", "-f", "qcow2", p, fmt.Sprint(s.EmptyDisk.Capacity.Value())); err != nil {
				return fmt.Errorf("%s: empty disk: %w", path, err)
			}
			created = append(created, p)
		case s.Ephemeral != nil || s.ContainerDisk != nil:
			p, what := env.EphemeralPath(vol.Name), "ephemeral overlay"
			if s.ContainerDisk != nil {
				p, what = env.ContainerDiskPath(vol.Name), "containerDisk overlay"
			}
			if exists(p) {
				continue
			}
			backing, ok := env.Disks[vol.Name]
			if !ok {
				return fmt.Errorf("%s: no disk image for volume %q on this node", path, vol.Name)
			}
			format := backing.Format
			if format == "" {
				format = FormatRaw
			}
			if err := qemuImg(ctx, "create", "-q", "-f", "qcow2", "-F", string(format), "-b", backing.Path, p); err != nil {
				return fmt.Errorf("%s: %s: %w", path, what, err)
			}
			created = append(created, p)
		case s.ConfigMap != nil || s.Secret != nil:
			p := env.ConfigDiskPath(vol.Name)
			fresh := !exists(p)
			if err := buildConfigDisk(ctx, path, vol, env, p); err != nil {
				return err
			}
			if fresh {
				created = append(created, p)
			}
		default:
			d, ok, err := env.cloudInit(path, vol)
			if err != nil {
				return err
			}
			if !ok {
				continue
			}
			p := env.CloudInitPath(vol.Name)
			fresh := !exists(p)
			if err := buildCloudInitISO(ctx, vmi, d, p); err != nil {
				return fmt.Errorf("%s: %w", path, err)
			}
			if fresh {
				created = append(created, p)
			}
		}
	}
	return nil
}

// DefaultConfigDiskLabel is the volume id of a configMap or secret disk
// without a volumeLabel.
const DefaultConfigDiskLabel = "cfgdata"

// buildConfigDisk makes the ISO of a configMap or secret volume: one file
// per key. A missing optional object gives an empty disk.
func buildConfigDisk(ctx context.Context, path string, vol *v1.Volume, env Env, iso string) error {
	var (
		data     map[string][]byte
		found    bool
		optional bool
		label    string
		what     string
	)
	if cm := vol.ConfigMap; cm != nil {
		data, found = env.ConfigMaps[cm.Name]
		optional, label, what = cm.Optional != nil && *cm.Optional, cm.VolumeLabel, "configMap "+cm.Name
		path += ".configMap"
	} else {
		sec := vol.Secret
		data, found = env.Secrets[sec.SecretName]
		optional, label, what = sec.Optional != nil && *sec.Optional, sec.VolumeLabel, "secret "+sec.SecretName
		path += ".secret"
	}
	if !found && !optional {
		return fmt.Errorf("%s: %s was not supplied", path, what)
	}
	if label == "" {
		label = DefaultConfigDiskLabel
	}
	files := map[string][]byte{}
	for k, v := range data {
		files[k] = v
	}
	if err := buildISO(ctx, iso, label, files); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func qemuImg(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "qemu-img", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img %s: %w: %s", args[0], err, out)
	}
	return nil
}
