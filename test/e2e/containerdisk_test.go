package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry/registrytest"
	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestContainerDisk: a VMI written as KubeVirt's documentation writes one,
// booting from a containerDisk in a registry (loopback, plain HTTP, basic
// auth through an imagePullSecret, listed as insecure in the
// HyperConverged), reaches its guest's READY line on a qcow2 overlay of
// the image the node agent pulled; deleting it removes the overlay. A VMI
// whose image does not exist stays Scheduled with a condition naming the
// image and why.
func TestContainerDisk(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	reg, host := serveContainerDisk(t, "e2e/guest", "v1", "puller", "e2e-pw")
	e.allowInsecureRegistry(t, host)

	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "registry-pull", Namespace: n.name},
		Type:       corev1.SecretTypeDockerConfigJson,
		Data:       map[string][]byte{corev1.DockerConfigJsonKey: registrytest.DockerConfigJSON(host, "puller", "e2e-pw")},
	}
	if _, err := e.kube.CoreV1().Secrets(n.name).Create(context.Background(), secret, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	withContainerDisk := func(image string) vmiOption {
		return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Volumes[0].VolumeSource = kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{
				Image: image, ImagePullSecret: "registry-pull"}}
		}
	}
	newVMI := func(name, image string) *kubevirtv1.VirtualMachineInstance {
		return &kubevirtv1.VirtualMachineInstance{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.name},
			Spec:       vmiSpec("unused", withContainerDisk(image)),
		}
	}

	n.createVMI(newVMI("missing", host+"/e2e/absent:v1"))
	// While its image downloads, the VMI stays Scheduled and says why.
	release := reg.Hold("e2e/guest")
	t0 := time.Now()
	n.createVMI(newVMI("fromregistry", host+"/e2e/guest:v1"))
	pulling := n.waitVMI("fromregistry", 60*time.Second, "waiting for its image", func(v *kubevirtv1.VirtualMachineInstance) bool {
		for _, c := range v.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineInstanceSynchronized && c.Reason == "Waiting" &&
				strings.Contains(c.Message, "e2e/guest:v1: image pull in progress") {
				return true
			}
		}
		return false
	})
	if pulling.Status.Phase != kubevirtv1.Scheduled {
		t.Errorf("vmi pulling its image in phase %s, want Scheduled", pulling.Status.Phase)
	}
	time.Sleep(time.Second)
	release()

	n.waitRunning("fromregistry")
	running := time.Since(t0)
	serial := n.waitBooted("fromregistry")
	t.Logf("containerDisk vmi: create → Running (pull held 1 s included) %s, → guest READY %s",
		running.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond))
	if !serial.contains(`NODEVIRT-DISK vda 67108864`) {
		t.Errorf("the guest did not see its 64 MiB containerDisk as vda")
	}
	dom, err := domainXML(n.name, "fromregistry")
	if err != nil {
		t.Fatal(err)
	}
	var overlay string
	for _, d := range dom.Devices.Disks {
		if d.Alias != nil && d.Alias.Name == "ua-rootdisk" {
			overlay = diskSource(d.Source)
		}
	}
	if overlay == "" {
		t.Fatalf("no rootdisk in the domain")
	}
	info, err := exec.Command("qemu-img", "info", "-U", "--output=json", overlay).Output()
	if err != nil {
		t.Fatalf("qemu-img info %s: %v", overlay, err)
	}
	var img struct {
		Format  string `json:"format"`
		Backing string `json:"backing-filename"`
	}
	json.Unmarshal(info, &img)
	if img.Format != "qcow2" || !strings.Contains(img.Backing, "/containerdisks/images/") {
		t.Errorf("root disk %s: format %s backing %q, want a qcow2 overlay on the node's image cache", overlay, img.Format, img.Backing)
	}
	if _, err := os.Stat(img.Backing); err != nil {
		t.Errorf("cached image: %v", err)
	}

	missing := n.waitVMI("missing", 60*time.Second, "reporting the failed pull", func(v *kubevirtv1.VirtualMachineInstance) bool {
		for _, c := range v.Status.Conditions {
			if c.Type == kubevirtv1.VirtualMachineInstanceSynchronized && c.Status == corev1.ConditionFalse &&
				(c.Reason == "ErrImagePull" || c.Reason == "ImagePullBackOff") {
				return true
			}
		}
		return false
	})
	if missing.Status.Phase != kubevirtv1.Scheduled {
		t.Errorf("vmi with a missing image in phase %s, want Scheduled", missing.Status.Phase)
	}
	for _, c := range missing.Status.Conditions {
		if c.Type != kubevirtv1.VirtualMachineInstanceSynchronized {
			continue
		}
		t.Logf("vmi with a missing image: %s=%s %s: %s", c.Type, c.Status, c.Reason, c.Message)
		if !strings.Contains(c.Message, "e2e/absent:v1") || !strings.Contains(c.Message, "SourceNotFound") {
			t.Errorf("condition message %q does not name the image and the reason", c.Message)
		}
	}

	n.deleteVMI("fromregistry", nil)
	n.waitGone("fromregistry", 90*time.Second)
	if _, err := os.Stat(overlay); !os.IsNotExist(err) {
		t.Errorf("overlay %s left after the vmi was deleted: %v", overlay, err)
	}
}

// allowInsecureRegistry lists host in the HyperConverged's
// storageImport.insecureRegistries until the test ends, and waits until the
// brain has passed it on to the CDI configuration.
func (e *env) allowInsecureRegistry(t *testing.T, host string) {
	t.Helper()
	ctx := context.Background()
	edit := func(f func([]string) []string) error {
		for {
			hco, err := e.virt.HyperConvergeds.Get(ctx, hcov1beta1.DefaultNamespace, hcov1beta1.Name)
			if err != nil {
				return err
			}
			if hco.Spec.StorageImport == nil {
				hco.Spec.StorageImport = &hcov1beta1.StorageImportConfig{}
			}
			hco.Spec.StorageImport.InsecureRegistries = f(hco.Spec.StorageImport.InsecureRegistries)
			_, err = e.virt.HyperConvergeds.Update(ctx, hco)
			if !apierrors.IsConflict(err) {
				return err
			}
		}
	}
	if err := edit(func(l []string) []string { return append(l, host) }); err != nil {
		t.Fatalf("list %s as insecure in the HyperConverged: %v", host, err)
	}
	t.Cleanup(func() {
		edit(func(l []string) []string { return slices.DeleteFunc(l, func(s string) bool { return s == host }) })
	})
	testkit.PollEvery(t, 250*time.Millisecond, 60*time.Second, "the CDI configuration to list "+host+" as the HyperConverged does (clusterbrain/hco)", func() (bool, error) {
		cdis, err := e.virt.CDIs.List(ctx, "", metav1.ListOptions{})
		return err == nil && len(cdis) > 0 && cdis[0].Spec.Config != nil && slices.Contains(cdis[0].Spec.Config.InsecureRegistries, host), err
	})
}

// serveContainerDisk serves, until the test ends, a containerDisk image
// repo:tag holding the test guest's boot disk as qcow2 under /disk/ in a
// gzipped layer, over plain HTTP on loopback behind basic auth.
func serveContainerDisk(t *testing.T, repo, tag, user, pass string) (*registrytest.Registry, string) {
	t.Helper()
	raw, err := bootDisk()
	if err != nil {
		t.Fatalf("guest image: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	qcow2, err := guest.QCOW2(ctx, raw)
	if err != nil {
		t.Fatalf("guest qcow2 image: %v", err)
	}
	disk, err := os.ReadFile(qcow2)
	if err != nil {
		t.Fatal(err)
	}
	reg := registrytest.New()
	reg.SetAuth(user, pass)
	if _, _, err := reg.Publish(repo, tag, map[string][]byte{"disk/guest.qcow2": disk}); err != nil {
		t.Fatal(err)
	}
	host, stop := reg.Serve()
	t.Cleanup(stop)
	return reg, host
}
