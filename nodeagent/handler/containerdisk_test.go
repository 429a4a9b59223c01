package handler

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry/registrytest"
	"github.com/nodevirt/nodevirt/test/guest"
)

// containerDiskVMI starts paused from a containerDisk (no guest CPU spent).
func containerDiskVMI(name, image string) *v1.VirtualMachineInstance {
	paused := v1.StartStrategyPaused
	return &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.VirtualMachineInstanceSpec{
			StartStrategy:                 &paused,
			TerminationGracePeriodSeconds: int64p(0),
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}},
				Devices: v1.Devices{
					AutoattachGraphicsDevice: new(bool),
					Disks:                    []v1.Disk{{Name: "root", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}},
				},
			},
			Volumes: []v1.Volume{{Name: "root", VolumeSource: v1.VolumeSource{ContainerDisk: &v1.ContainerDiskSource{Image: image}}}},
		},
	}
}

// TestContainerDiskPullDoesNotBlock: with a single reconcile worker, a VMI
// whose image download hangs waits in Scheduled (Synchronized=False,
// Waiting) while another VMI of the node starts; when the download
// completes the first starts too. Deleting them releases their images.
func TestContainerDiskPullDoesNotBlock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	n := newNode(t)
	raw, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		t.Fatal(err)
	}
	qcow2, err := guest.QCOW2(ctx, raw)
	if err != nil {
		t.Fatal(err)
	}
	disk, err := os.ReadFile(qcow2)
	if err != nil {
		t.Fatal(err)
	}
	reg := registrytest.New()
	for _, repo := range []string{"slow/guest", "fast/guest"} {
		if _, _, err := reg.Publish(repo, "v1", map[string][]byte{"disk/disk.qcow2": disk}); err != nil {
			t.Fatal(err)
		}
	}
	host, stop := reg.Serve()
	defer stop()
	release := reg.Hold("slow/guest")
	defer release()

	cdi := &cdiv1.CDI{ObjectMeta: metav1.ObjectMeta{Name: "cdi",
		Annotations: map[string]string{importstate.AnnImportAllowedNetworks: "127.0.0.0/8"}},
		Spec: cdiv1.CDISpec{Config: &cdiv1.CDIConfigSpec{InsecureRegistries: []string{host}}}}
	if _, err := n.virt.CDIs.Create(ctx, cdi); err != nil {
		t.Fatal(err)
	}
	defer n.virt.CDIs.Delete(context.Background(), "", "cdi", metav1.DeleteOptions{})

	h, err := New(Config{
		NodeName: n.name, StateDir: n.stateDir, LibvirtURI: n.uri, Emulation: true, Workers: 1,
		Kube: n.kube, Virt: n.virt, ShutdownRetry: 2 * time.Second,
		Log: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo})).With("node", n.name),
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- h.Run(runCtx) }()
	defer func() {
		cancel()
		<-done
	}()

	n.schedule(ctx, containerDiskVMI("slow", host+"/slow/guest:v1"))
	n.waitVMI(ctx, "slow", 30*time.Second, "waiting for its image", func(v *v1.VirtualMachineInstance) bool {
		c := condition(v, v1.VirtualMachineInstanceSynchronized)
		return c != nil && c.Reason == "Waiting" && strings.Contains(c.Message, "slow/guest:v1: image pull in progress")
	})
	t0 := time.Now()
	n.schedule(ctx, containerDiskVMI("fast", host+"/fast/guest:v1"))
	n.waitVMI(ctx, "fast", 60*time.Second, "Running beside the hanging pull", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Running
	})
	t.Logf("a second vmi reached Running in %s while the first one's pull hung", time.Since(t0).Round(time.Millisecond))
	if v, err := n.virt.VMIs.Get(ctx, n.ns, "slow"); err != nil || v.Status.Phase != v1.Scheduled {
		t.Fatalf("vmi with the hanging pull: %v, want phase Scheduled", err)
	}

	release()
	n.waitVMI(ctx, "slow", 60*time.Second, "Running once its image arrived", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Running && condition(v, v1.VirtualMachineInstanceSynchronized) == nil
	})

	cache, err := h.containerDisks()
	if err != nil {
		t.Fatal(err)
	}
	imgs, err := cache.Images()
	if err != nil || len(imgs) != 1 {
		t.Fatalf("cached images %v (%v), want one shared by both vmis", imgs, err)
	}
	for img, users := range imgs {
		if len(users) != 2 {
			t.Errorf("image %s users %v, want both vmis", img.Digest, users)
		}
	}
	for _, name := range []string{"slow", "fast"} {
		if err := n.virt.VMIs.Delete(ctx, n.ns, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		n.waitVMI(ctx, name, 60*time.Second, "gone", func(v *v1.VirtualMachineInstance) bool { return v == nil })
	}
	imgs, err = cache.Images()
	if err != nil {
		t.Fatal(err)
	}
	for img, users := range imgs {
		if len(users) != 0 {
			t.Errorf("image %s still used by %v after both vmis were deleted", img.Digest, users)
		}
	}
}
