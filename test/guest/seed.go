package guest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
)

// NoCloudSeed writes dir/nocloud.iso, a cloud-init NoCloud seed: an ISO9660
// image with volume id "cidata" holding user-data, meta-data and, when
// networkData is not empty, network-config. An empty metaData becomes a
// minimal instance-id/local-hostname document. Attach the ISO as a CD-ROM
// or a disk; the default guest prints and runs its user-data.
func NoCloudSeed(dir string, userData, metaData, networkData string) (string, error) {
	if metaData == "" {
		metaData = "instance-id: nodevirt-guest\nlocal-hostname: nodevirt-guest\n"
	}
	files := map[string]string{"user-data": userData, "meta-data": metaData}
	if networkData != "" {
		files["network-config"] = networkData
	}
	iso, err := makeSeed(dir, "nocloud.iso", "cidata", files)
	if err != nil {
		return "", fmt.Errorf("nocloud seed: %w", err)
	}
	return iso, nil
}

// ConfigDriveSeed writes dir/configdrive.iso, an OpenStack config drive:
// volume id "config-2" with openstack/latest/user_data, meta_data.json and,
// when networkData is not empty, network_data.json. metaData and networkData
// are JSON documents; an empty metaData becomes a minimal uuid/hostname one.
func ConfigDriveSeed(dir string, userData, metaData, networkData string) (string, error) {
	if metaData == "" {
		metaData = `{"uuid": "nodevirt-guest", "hostname": "nodevirt-guest"}` + "\n"
	}
	files := map[string]string{
		"openstack/latest/user_data":      userData,
		"openstack/latest/meta_data.json": metaData,
	}
	if networkData != "" {
		files["openstack/latest/network_data.json"] = networkData
	}
	iso, err := makeSeed(dir, "configdrive.iso", "config-2", files)
	if err != nil {
		return "", fmt.Errorf("config drive seed: %w", err)
	}
	return iso, nil
}

// makeSeed lays files out in a staging directory and makes an ISO of it.
func makeSeed(dir, name, volid string, files map[string]string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	stage, err := os.MkdirTemp(dir, ".seed-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(stage)
	for rel, content := range files {
		p := filepath.Join(stage, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return "", err
		}
	}
	iso := filepath.Join(dir, name)
	if _, err := run(context.Background(), "", "genisoimage", "-quiet", "-output", iso,
		"-volid", volid, "-joliet", "-rock", stage); err != nil {
		return "", err
	}
	return iso, nil
}
