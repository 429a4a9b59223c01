package domain

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	k8sv1 "k8s.io/api/core/v1"
	v1 "kubevirt.io/api/core/v1"
)

// cloudInitSource is the common shape of cloudInitNoCloud and
// cloudInitConfigDrive.
type cloudInitSource struct {
	userDataSecret, networkDataSecret *k8sv1.LocalObjectReference
	userData, userDataBase64          string
	networkData, networkDataBase64    string
}

// cloudInitData is the resolved content of a cloud-init volume.
type cloudInitData struct {
	configDrive bool
	userData    []byte
	networkData []byte
}

func (e *Env) secretKey(ref *k8sv1.LocalObjectReference, keys ...string) ([]byte, error) {
	data, ok := e.Secrets[ref.Name]
	if !ok {
		return nil, fmt.Errorf("secret %q was not supplied", ref.Name)
	}
	for _, k := range keys {
		if v, ok := data[k]; ok {
			return v, nil
		}
	}
	return nil, fmt.Errorf("secret %q has none of the keys %q", ref.Name, keys)
}

func (e *Env) resolve(what string, secret *k8sv1.LocalObjectReference, inline, b64 string, keys ...string) ([]byte, error) {
	set := 0
	for _, s := range []bool{secret != nil, inline != "", b64 != ""} {
		if s {
			set++
		}
	}
	if set > 1 {
		return nil, fmt.Errorf("%s: more than one source set", what)
	}
	switch {
	case secret != nil:
		v, err := e.secretKey(secret, keys...)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		return v, nil
	case b64 != "":
		v, err := base64.StdEncoding.DecodeString(b64)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		return v, nil
	default:
		return []byte(inline), nil
	}
}

// cloudInit resolves a cloud-init volume; ok is false for other volumes.
func (e *Env) cloudInit(path string, vol *v1.Volume) (d cloudInitData, ok bool, err error) {
	var src cloudInitSource
	switch s := vol.VolumeSource; {
	case s.CloudInitNoCloud != nil:
		n := s.CloudInitNoCloud
		src = cloudInitSource{n.UserDataSecretRef, n.NetworkDataSecretRef, n.UserData, n.UserDataBase64, n.NetworkData, n.NetworkDataBase64}
		path += ".cloudInitNoCloud"
	case s.CloudInitConfigDrive != nil:
		n := s.CloudInitConfigDrive
		src = cloudInitSource{n.UserDataSecretRef, n.NetworkDataSecretRef, n.UserData, n.UserDataBase64, n.NetworkData, n.NetworkDataBase64}
		d.configDrive = true
		path += ".cloudInitConfigDrive"
	default:
		return d, false, nil
	}
	d.userData, err = e.resolve(path+" user data", src.userDataSecret, src.userData, src.userDataBase64, "userdata", "userData")
	if err != nil {
		return d, true, err
	}
	d.networkData, err = e.resolve(path+" network data", src.networkDataSecret, src.networkData, src.networkDataBase64, "networkdata", "networkData")
	if err != nil {
		return d, true, err
	}
	if len(d.userData) == 0 && len(d.networkData) == 0 {
		return d, true, fmt.Errorf("%s: neither user data nor network data", path)
	}
	return d, true, nil
}

// buildCloudInitISO writes the seed of vmi to iso: a NoCloud seed (volume id
// cidata: meta-data, user-data, network-config) or an OpenStack config drive
// (volume id config-2: openstack/latest/{meta_data.json,user_data,
// network_data.json}).
func buildCloudInitISO(ctx context.Context, vmi *v1.VirtualMachineInstance, d cloudInitData, iso string) error {
	hostname := vmi.Spec.Hostname
	if hostname == "" {
		hostname = vmi.Name
	}
	instanceID := string(vmi.UID)
	if instanceID == "" {
		instanceID = vmi.Name + "." + vmi.Namespace
	}
	files := map[string][]byte{}
	volid := "cidata"
	if d.configDrive {
		volid = "config-2"
		md, err := json.Marshal(map[string]string{"uuid": instanceID, "hostname": hostname, "name": vmi.Name})
		if err != nil {
			return fmt.Errorf("build config drive: %w", err)
		}
		files["openstack/latest/meta_data.json"] = md
		if len(d.userData) > 0 {
			files["openstack/latest/user_data"] = d.userData
		}
		if len(d.networkData) > 0 {
			files["openstack/latest/network_data.json"] = d.networkData
		}
	} else {
		// JSON is YAML: cloud-init reads this meta-data as it reads YAML.
		md, err := json.Marshal(map[string]string{"instance-id": instanceID, "local-hostname": hostname})
		if err != nil {
			return fmt.Errorf("build nocloud seed: %w", err)
		}
		files["meta-data"] = md
		files["user-data"] = d.userData
		if len(d.networkData) > 0 {
			files["network-config"] = d.networkData
		}
	}
	return buildISO(ctx, iso, volid, files)
}

// ISOMode is the mode of cloud-init, configMap and Secret images: they
// carry user data, passwords and keys, so no other host user reads them.
const ISOMode = 0o600

// buildISO writes an ISO9660 image (Joliet and Rock Ridge names) with volume
// id volid holding files (path in the image -> content). It is built beside
// iso and renamed into place.
func buildISO(ctx context.Context, iso, volid string, files map[string][]byte) error {
	root, err := os.MkdirTemp(filepath.Dir(iso), ".iso-")
	if err != nil {
		return fmt.Errorf("build iso: %w", err)
	}
	defer os.RemoveAll(root)
	for name, content := range files {
		p := filepath.Join(root, filepath.FromSlash(name))
		if !strings.HasPrefix(p, root+string(filepath.Separator)) {
			return fmt.Errorf("build iso: file name %q leaves the image", name)
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			return fmt.Errorf("build iso: %w", err)
		}
		if err := os.WriteFile(p, content, 0o600); err != nil {
			return fmt.Errorf("build iso: %w", err)
		}
	}
	tmp := iso + ".tmp"
	out, err := exec.CommandContext(ctx, "genisoimage", "-quiet", "-output", tmp,
		// Rational Rock Ridge: the guest sees the files readable (the
		// host's staging copies are root's alone).
		"-volid", volid, "-joliet", "-rational-rock", root).CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("genisoimage: %w: %s", err, out)
	}
	// The seed holds user data and Secret values: root alone reads it.
	// libvirt's DAC driver (dynamic_ownership, on by default) hands the
	// image to QEMU's user while the domain runs and gives it back after.
	if err := os.Chmod(tmp, ISOMode); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("build iso: %w", err)
	}
	if err := os.Rename(tmp, iso); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("build iso: %w", err)
	}
	return nil
}
