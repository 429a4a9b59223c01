package handler

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// TestGuestWrittenHeaderDoesNotChangeTheFormat: a guest that writes a
// qcow2 header naming /etc/passwd as backing file into its own raw disk
// finds, at the next start, its disk still opened as raw: the disk source
// the node resolves and the domain it defines say raw, and nothing in the
// domain names the host file.
func TestGuestWrittenHeaderDoesNotChangeTheFormat(t *testing.T) {
	ctx := context.Background()
	cp := controlplane.Shared(t)
	n := &node{t: t, name: "node-format", ns: cp.Namespace(t), kube: cp.Clientset(t)}
	n.csiRoot = reachableDir(t, "nodevirt-handler-csi-")
	var err error
	n.csi, err = csi.New(csi.Config{NodeID: n.name, StateRoot: n.csiRoot, Endpoint: n.csiRoot + "/csi.sock",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	n.bootVolume(ctx, "data")
	pvc, err := n.kube.CoreV1().PersistentVolumeClaims(n.ns).Get(ctx, "data", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv, err := n.kube.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	disk, _, err := n.csi.VolumeDisk(pv.Spec.CSI.VolumeHandle)
	if err != nil {
		t.Fatal(err)
	}

	// What the guest writes at sector 0 of its disk: a real qcow2 header
	// with /etc/passwd as raw backing file.
	hdr := t.TempDir() + "/hdr.qcow2"
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", "/etc/passwd", hdr, "64M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	head, err := os.ReadFile(hdr)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(disk, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(head[:64<<10], 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	// qemu itself, asked to guess, now sees a qcow2 on /etc/passwd.
	if out, _ := exec.Command("qemu-img", "info", "-U", disk).CombinedOutput(); !strings.Contains(string(out), "/etc/passwd") {
		t.Fatalf("the planted header is not what qemu would follow:\n%s", out)
	}

	h := &Handler{cfg: Config{Kube: n.kube, Volumes: n.csi}}
	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "vm", Namespace: n.ns},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{Memory: &v1.Memory{Guest: resource.NewQuantity(128<<20, resource.BinarySI)}, Devices: v1.Devices{Disks: []v1.Disk{{Name: "data",
				DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}}}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
					PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}}},
		},
	}
	disks, err := h.resolveDisks(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	if got := disks["data"]; got.Format != domain.FormatRaw || got.Path != disk {
		t.Fatalf("disk source %+v, want raw %s", got, disk)
	}
	dom, err := domain.Convert(vmi, domain.Env{StateDir: t.TempDir(), Disks: disks, Emulation: true})
	if err != nil {
		t.Fatal(err)
	}
	xml, err := dom.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, d := range dom.Devices.Disks {
		if d.Source != nil && d.Source.File != nil && d.Source.File.File == disk {
			found = true
			if d.Driver == nil || d.Driver.Type != "raw" {
				t.Errorf("disk driver %+v, want type raw", d.Driver)
			}
			if d.BackingStore != nil {
				t.Errorf("disk has a backing store %+v", d.BackingStore)
			}
		}
	}
	if !found {
		t.Fatalf("domain has no disk on %s:\n%s", disk, xml)
	}
	if strings.Contains(xml, "/etc/passwd") {
		t.Errorf("domain names /etc/passwd:\n%s", xml)
	}
}
