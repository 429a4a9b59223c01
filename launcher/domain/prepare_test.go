package domain

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	v1 "kubevirt.io/api/core/v1"
)

// isoFile extracts one file of an ISO9660 image (Rock Ridge names).
func isoFile(t *testing.T, iso, path string) string {
	t.Helper()
	out, err := exec.Command("isoinfo", "-R", "-i", iso, "-x", path).Output()
	if err != nil {
		t.Fatalf("isoinfo %s %s: %v", iso, path, err)
	}
	return string(out)
}

func isoVolumeID(t *testing.T, iso string) string {
	t.Helper()
	out, err := exec.Command("isoinfo", "-d", "-i", iso).Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(l, "Volume id: "); ok {
			return v
		}
	}
	t.Fatalf("no volume id in %s", out)
	return ""
}

func qemuImgInfo(t *testing.T, path string) map[string]any {
	t.Helper()
	out, err := exec.Command("qemu-img", "info", "-U", "--output=json", path).Output()
	if err != nil {
		t.Fatalf("qemu-img info %s: %v", path, err)
	}
	var info map[string]any
	if err := json.Unmarshal(out, &info); err != nil {
		t.Fatal(err)
	}
	return info
}

func TestPrepareMakesDisksAndSeeds(t *testing.T) {
	ctx := context.Background()
	tmp := t.TempDir()
	backing := filepath.Join(tmp, "golden.img")
	if err := os.WriteFile(backing, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	vmi := loadVMI(t, "testdata/emulation-headless.yaml")
	vmi.Spec.Hostname = "seeded"
	vmi.Spec.Volumes = append(vmi.Spec.Volumes,
		v1.Volume{Name: "overlay", VolumeSource: v1.VolumeSource{Ephemeral: &v1.EphemeralVolumeSource{
			PersistentVolumeClaim: &k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "golden"}}}},
		v1.Volume{Name: "drive", VolumeSource: v1.VolumeSource{CloudInitConfigDrive: &v1.CloudInitConfigDriveSource{
			UserDataSecretRef: &k8sv1.LocalObjectReference{Name: "ud"}, NetworkData: `{"links":[]}`}}},
		v1.Volume{Name: "cm", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{
			LocalObjectReference: k8sv1.LocalObjectReference{Name: "app"}, VolumeLabel: "APPCFG"}}},
		v1.Volume{Name: "sec", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: "ud"}}},
		v1.Volume{Name: "host", VolumeSource: v1.VolumeSource{HostDisk: &v1.HostDisk{
			Path: filepath.Join(tmp, "host.img"), Type: v1.HostDiskExistsOrCreate, Capacity: resource.MustParse("2Mi")}}},
	)
	env := Env{
		StateDir:   filepath.Join(tmp, "state"),
		Disks:      map[string]DiskSource{"overlay": {Path: backing}},
		Secrets:    map[string]map[string][]byte{"ud": {"userdata": []byte("#cloud-config\nfrom: secret\n")}},
		ConfigMaps: map[string]map[string][]byte{"app": {"app.conf": []byte("port=8080\n")}},
	}
	if err := Prepare(ctx, vmi, env); err != nil {
		t.Fatal(err)
	}

	empty := qemuImgInfo(t, env.EmptyDiskPath("empty"))
	if empty["format"] != "qcow2" || empty["virtual-size"] != float64(64<<20) {
		t.Errorf("empty disk: %v", empty)
	}
	overlay := qemuImgInfo(t, env.EphemeralPath("overlay"))
	if overlay["format"] != "qcow2" || overlay["backing-filename"] != backing || overlay["backing-filename-format"] != "raw" {
		t.Errorf("ephemeral overlay: %v", overlay)
	}
	// A hostDisk path is the node agent's to confine and create: Prepare
	// never writes where a user's spec points.
	if _, err := os.Stat(filepath.Join(tmp, "host.img")); !os.IsNotExist(err) {
		t.Errorf("prepare created the hostDisk path itself: %v", err)
	}

	seed := env.CloudInitPath("seed")
	if id := isoVolumeID(t, seed); id != "cidata" {
		t.Errorf("nocloud volume id %q", id)
	}
	if ud := isoFile(t, seed, "/user-data"); ud != "#cloud-config\n" {
		t.Errorf("nocloud user-data %q", ud)
	}
	if nd := isoFile(t, seed, "/network-config"); nd != "version: 2\n" {
		t.Errorf("nocloud network-config %q", nd)
	}
	var md map[string]string
	if err := json.Unmarshal([]byte(isoFile(t, seed, "/meta-data")), &md); err != nil ||
		md["instance-id"] != string(vmi.UID) || md["local-hostname"] != "seeded" {
		t.Errorf("nocloud meta-data %v %v", md, err)
	}

	drive := env.CloudInitPath("drive")
	if id := isoVolumeID(t, drive); id != "config-2" {
		t.Errorf("config drive volume id %q", id)
	}
	if ud := isoFile(t, drive, "/openstack/latest/user_data"); ud != "#cloud-config\nfrom: secret\n" {
		t.Errorf("config drive user_data %q", ud)
	}
	if nd := isoFile(t, drive, "/openstack/latest/network_data.json"); nd != `{"links":[]}` {
		t.Errorf("config drive network_data %q", nd)
	}

	cm := env.ConfigDiskPath("cm")
	if id := isoVolumeID(t, cm); id != "APPCFG" {
		t.Errorf("configMap disk volume id %q", id)
	}
	if got := isoFile(t, cm, "/app.conf"); got != "port=8080\n" {
		t.Errorf("configMap disk app.conf %q", got)
	}
	sec := env.ConfigDiskPath("sec")
	if id := isoVolumeID(t, sec); id != DefaultConfigDiskLabel {
		t.Errorf("secret disk volume id %q", id)
	}
	if got := isoFile(t, sec, "/userdata"); got != "#cloud-config\nfrom: secret\n" {
		t.Errorf("secret disk userdata %q", got)
	}

	// Seeds and config disks hold user data and Secret values: no host
	// user but root reads them (libvirt hands them to QEMU while it runs).
	for _, iso := range []string{seed, drive, cm, sec} {
		fi, err := os.Stat(iso)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != ISOMode {
			t.Errorf("%s: mode %v, want %v", filepath.Base(iso), fi.Mode().Perm(), os.FileMode(ISOMode))
		}
	}

	// Idempotent: a second run keeps the images (guest data) as they are.
	before, _ := os.Stat(env.EmptyDiskPath("empty"))
	if err := Prepare(ctx, vmi, env); err != nil {
		t.Fatal(err)
	}
	after, _ := os.Stat(env.EmptyDiskPath("empty"))
	if !before.ModTime().Equal(after.ModTime()) {
		t.Error("second Prepare rewrote the empty disk")
	}
}

func TestPrepareUndoesOnFailure(t *testing.T) {
	tmp := t.TempDir()
	vmi := loadVMI(t, "testdata/emulation-headless.yaml")
	// The seed refers to a Secret the caller did not supply: Prepare fails
	// after making the empty disk, and removes it and the state dir.
	vmi.Spec.Volumes[2].CloudInitNoCloud = &v1.CloudInitNoCloudSource{
		UserDataSecretRef: &k8sv1.LocalObjectReference{Name: "missing"}}
	env := Env{StateDir: filepath.Join(tmp, "state")}
	err := Prepare(context.Background(), vmi, env)
	if err == nil || !strings.Contains(err.Error(), `secret "missing" was not supplied`) {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(env.StateDir); !os.IsNotExist(err) {
		t.Fatalf("state dir left behind: %v", err)
	}
}

func TestConfigDiskNeedsItsObject(t *testing.T) {
	vmi := loadVMI(t, "testdata/emulation-headless.yaml")
	vmi.Spec.Volumes[1].VolumeSource = v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{
		LocalObjectReference: k8sv1.LocalObjectReference{Name: "absent"}}}
	env := Env{StateDir: t.TempDir()}
	err := Prepare(context.Background(), vmi, env)
	if err == nil || !strings.Contains(err.Error(), "spec.volumes[1].configMap: configMap absent was not supplied") {
		t.Fatalf("err = %v", err)
	}
	optional := true
	vmi.Spec.Volumes[1].ConfigMap.Optional = &optional
	if err := Prepare(context.Background(), vmi, env); err != nil {
		t.Fatalf("optional configMap: %v", err)
	}
}

func TestCloudInitSourcesAreExclusive(t *testing.T) {
	vmi := loadVMI(t, "testdata/emulation-headless.yaml")
	vmi.Spec.Volumes[2].CloudInitNoCloud.UserData = "#cloud-config\n"
	env := Env{StateDir: t.TempDir()}
	err := Prepare(context.Background(), vmi, env)
	if err == nil || !strings.Contains(err.Error(), "spec.volumes[2].cloudInitNoCloud user data: more than one source set") {
		t.Fatalf("err = %v", err)
	}
}

func TestPrepareContainerDiskOverlay(t *testing.T) {
	ctx := context.Background()
	tmp := t.TempDir()
	cached := filepath.Join(tmp, "cache", "disk.img")
	os.MkdirAll(filepath.Dir(cached), 0o755)
	if err := os.WriteFile(cached, make([]byte, 2<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	vmi := loadVMI(t, "testdata/containerdisk.yaml")
	env := Env{StateDir: filepath.Join(tmp, "state"), Disks: map[string]DiskSource{
		"containerdisk": {Path: cached, Format: FormatRaw},
		"tools":         {Path: cached},
	}}
	if err := Prepare(ctx, vmi, env); err != nil {
		t.Fatal(err)
	}
	for _, vol := range []string{"containerdisk", "tools"} {
		info := qemuImgInfo(t, env.ContainerDiskPath(vol))
		if info["format"] != "qcow2" || info["backing-filename"] != cached || info["backing-filename-format"] != "raw" ||
			info["virtual-size"] != float64(2<<20) {
			t.Errorf("containerDisk overlay %s: %v", vol, info)
		}
	}
	// Without the pulled image nothing is made.
	env.StateDir = filepath.Join(tmp, "state2")
	delete(env.Disks, "tools")
	if err := Prepare(ctx, vmi, env); err == nil || !strings.Contains(err.Error(), `no disk image for volume "tools"`) {
		t.Fatalf("prepare without the image: %v", err)
	}
	if _, err := os.Stat(env.StateDir); !os.IsNotExist(err) {
		t.Errorf("failed prepare left %s: %v", env.StateDir, err)
	}
}
