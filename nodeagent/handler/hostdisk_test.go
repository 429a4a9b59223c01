package handler

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
)

func hostDiskOnly(name, path string, typ v1.HostDiskType, capacity string) *v1.VirtualMachineInstance {
	hd := &v1.HostDisk{Path: path, Type: typ}
	if capacity != "" {
		hd.Capacity = resource.MustParse(capacity)
	}
	no := false
	return &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}},
				Devices: v1.Devices{AutoattachGraphicsDevice: &no,
					Disks: []v1.Disk{{Name: "host", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}}},
			},
			Volumes: []v1.Volume{{Name: "host", VolumeSource: v1.VolumeSource{HostDisk: hd}}},
		},
	}
}

// The node opens a hostDisk only with the HostDisk gate on and only inside
// its host disk root, without following symlinks: /etc/shadow, a path that
// climbs out with "..", and a symlink planted inside the root that points
// at /etc/shadow all fail the VMI with the reason, and no domain is made.
// A DiskOrCreate disk inside the root is created and used.
func TestHostDiskConfinedToRoot(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	n := newNode(t)
	n.hostDiskRoot = reachableDir(t, "nodevirt-hostdisks-")
	root := n.hostDiskRoot
	if err := os.Symlink("/etc/shadow", filepath.Join(root, "planted.img")); err != nil {
		t.Fatal(err)
	}
	n.handler(true)

	refused := func(vmi *v1.VirtualMachineInstance, want string) {
		t.Helper()
		n.schedule(ctx, vmi)
		got := n.waitVMI(ctx, vmi.Name, 30*time.Second, "failed", func(v *v1.VirtualMachineInstance) bool {
			return v.Status.Phase == v1.Failed
		})
		if s := condition(got, v1.VirtualMachineInstanceSynchronized); s == nil || !strings.Contains(s.Message, want) {
			t.Errorf("%s: Synchronized %+v, want a message containing %q", vmi.Name, s, want)
		}
		if _, err := n.lv.Lookup(ctx, n.ns+"_"+vmi.Name); err == nil {
			t.Errorf("%s: a domain exists", vmi.Name)
		}
	}
	refused(hostDiskOnly("nogate", filepath.Join(root, "disk.img"), v1.HostDiskExistsOrCreate, "16Mi"), "HostDisk feature gate is not enabled")
	if _, err := os.Stat(filepath.Join(root, "disk.img")); !os.IsNotExist(err) {
		t.Errorf("disk created without the gate: %v", err)
	}

	if _, err := n.virt.KubeVirts.Create(ctx, &v1.KubeVirt{
		ObjectMeta: metav1.ObjectMeta{Name: "kubevirt", Namespace: n.ns},
		Spec: v1.KubeVirtSpec{Configuration: v1.KubeVirtConfiguration{DeveloperConfiguration: &v1.DeveloperConfiguration{
			UseEmulation: true, FeatureGates: []string{featuregate.HostDisk}}}},
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // the handler's KubeVirt informer
	refused(hostDiskOnly("shadow", "/etc/shadow", v1.HostDiskExists, ""), "outside the node's host disk root")
	refused(hostDiskOnly("climb", root+"/../../etc/shadow", v1.HostDiskExists, ""), "outside the node's host disk root")
	refused(hostDiskOnly("planted", filepath.Join(root, "planted.img"), v1.HostDiskExists, ""), "symlink")

	vmi := n.schedule(ctx, hostDiskOnly("inside", filepath.Join(root, "vm", "disk.img"), v1.HostDiskExistsOrCreate, "16Mi"))
	n.waitVMI(ctx, vmi.Name, startTimeout, "Running", func(v *v1.VirtualMachineInstance) bool { return v.Status.Phase == v1.Running })
	if st, err := os.Stat(filepath.Join(root, "vm", "disk.img")); err != nil || st.Size() != 16<<20 {
		t.Errorf("created disk: %v %v", st, err)
	}
	dom, err := n.lv.DomainXML(ctx, n.ns+"_inside")
	if err != nil {
		t.Fatal(err)
	}
	if d := dom.Devices.Disks[0]; d.Source == nil || d.Source.File == nil || d.Source.File.File != filepath.Join(root, "vm", "disk.img") ||
		d.Driver.Type != "raw" {
		t.Errorf("domain disk %+v %+v", d.Source, d.Driver)
	}
}
