package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

// hostileImages writes images that name the host's /etc/passwd: a VMDK
// descriptor whose FLAT extent is the file (CVE-2024-32498) and a qcow2
// whose backing file is.
func hostileImages(t *testing.T) map[string]string {
	t.Helper()
	dir := t.TempDir()
	vmdk := filepath.Join(dir, "flat.vmdk")
	desc := "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 4 FLAT \"/etc/passwd\" 0\n"
	if err := os.WriteFile(vmdk, []byte(desc), 0o644); err != nil {
		t.Fatal(err)
	}
	qcow := filepath.Join(dir, "backing.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", "/etc/passwd", qcow, "16M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	return map[string]string{"vmdk": vmdk, "qcow2": qcow}
}

// TestHostileImagesAreRefused imports, over HTTP and by upload, images
// that name a host file: every DataVolume fails (HTTP) or the upload is
// refused, with reason UnsupportedImage and a message naming the file, and
// no volume holds a byte of it.
func TestHostileImagesAreRefused(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	images := hostileImages(t)
	passwd, err := os.ReadFile("/etc/passwd")
	if err != nil {
		t.Fatal(err)
	}
	class := "hostpath-csi"
	ctx := context.Background()
	for kind, path := range images {
		dv := &cdiv1.DataVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "http-" + kind, Namespace: n.name,
				Annotations: map[string]string{"cdi.kubevirt.io/storage.bind.immediate.requested": "true"}},
			Spec: cdiv1.DataVolumeSpec{
				Source: &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: serveFile(t, path)}},
				Storage: &cdiv1.StorageSpec{StorageClassName: &class, Resources: corev1.VolumeResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}}},
			},
		}
		if _, err := e.virt.DataVolumes.Create(ctx, dv); err != nil {
			t.Fatal(err)
		}
	}
	for kind := range images {
		name := "http-" + kind
		n.eventually(2*time.Minute, "datavolume "+name+" Failed with UnsupportedImage", func() (bool, string) {
			dv, err := e.virt.DataVolumes.Get(ctx, n.name, name)
			if err != nil {
				return false, err.Error()
			}
			for _, c := range dv.Status.Conditions {
				if c.Type == cdiv1.DataVolumeRunning && c.Reason == "UnsupportedImage" && strings.Contains(c.Message, "/etc/passwd") {
					return dv.Status.Phase == cdiv1.Failed, fmt.Sprintf("phase %q", dv.Status.Phase)
				}
			}
			return false, fmt.Sprintf("phase %q, conditions %+v", dv.Status.Phase, dv.Status.Conditions)
		})
		n.checkNoHostBytes(name, passwd)
	}

	u := n.upstreamVirtctl()
	proxy := e.uploadProxyURL(t)
	for kind, path := range images {
		name := "upload-" + kind
		out := u.fail(3*time.Minute, "image-upload", "dv", name, "--size=64Mi", "--storage-class=hostpath-csi",
			"--image-path="+path, "--insecure", "--uploadproxy-url="+proxy)
		n.eventually(30*time.Second, "claim "+name+" reports UnsupportedImage", func() (bool, string) {
			pvc, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			reason := pvc.Annotations["cdi.kubevirt.io/storage.condition.running.reason"]
			return reason == "UnsupportedImage", "reason " + reason + "; virtctl said: " + out
		})
		n.checkNoHostBytes(name, passwd)
	}
}

// checkNoHostBytes fails if the claim's volume holds a disk that contains
// the host file.
func (n *testNS) checkNoHostBytes(claim string, host []byte) {
	t, e := n.t, n.e
	t.Helper()
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(context.Background(), claim, metav1.GetOptions{})
	if err != nil || pvc.Spec.VolumeName == "" {
		return // never bound: no volume to hold anything
	}
	pv, err := e.kube.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil || pv.Spec.CSI == nil {
		return
	}
	dir := e.path("pools", poolName(), "volumes", pv.Spec.CSI.VolumeHandle)
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if b, _ := os.ReadFile(p); len(host) > 0 && bytes.Contains(b, host[:min(len(host), 64)]) {
			t.Errorf("%s holds bytes of the host's /etc/passwd", p)
		}
		return nil
	})
}
