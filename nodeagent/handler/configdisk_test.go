package handler

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/launcher/domain"
)

// A VMI's configMap and secret volumes reach the guest as ISO disks holding
// the objects' keys (a ConfigMap's text and binary keys alike); a missing
// optional ConfigMap gives an empty disk, a missing required one keeps the
// VMI waiting until it exists.
func TestConfigMapAndSecretVolumes(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n := newNode(t)
	n.handler(true)
	if _, err := n.kube.CoreV1().Secrets(n.ns).Create(ctx, &k8sv1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: n.ns},
		Data:       map[string][]byte{"token": []byte("s3cret")},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	yes, no := true, false
	disk := func(name string) v1.Disk {
		return v1.Disk{Name: name, DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}
	}
	paused := v1.StartStrategyPaused
	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "configdisks"},
		Spec: v1.VirtualMachineInstanceSpec{
			StartStrategy: &paused,
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}},
				Devices: v1.Devices{AutoattachGraphicsDevice: &no,
					Disks: []v1.Disk{disk("app"), disk("creds"), disk("extra")}},
			},
			Volumes: []v1.Volume{
				{Name: "app", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{
					LocalObjectReference: k8sv1.LocalObjectReference{Name: "app"}, VolumeLabel: "APPCFG"}}},
				{Name: "creds", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: "creds"}}},
				{Name: "extra", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{
					LocalObjectReference: k8sv1.LocalObjectReference{Name: "absent"}, Optional: &yes}}},
			},
		},
	}
	n.schedule(ctx, vmi)

	// The required ConfigMap does not exist yet: the VMI waits, not fails.
	time.Sleep(3 * time.Second)
	if v, err := n.virt.VMIs.Get(ctx, n.ns, vmi.Name); err != nil {
		t.Fatal(err)
	} else if v.Status.Phase == v1.Running || v.Status.Phase == v1.Failed {
		t.Fatalf("phase %s without the required ConfigMap", v.Status.Phase)
	}
	if _, err := n.kube.CoreV1().ConfigMaps(n.ns).Create(ctx, &k8sv1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: n.ns},
		Data:       map[string]string{"app.conf": "port=8080\n"},
		BinaryData: map[string][]byte{"blob.bin": {0, 1, 2, 0xff}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got := n.waitVMI(ctx, vmi.Name, startTimeout, "Running", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running
	})

	env := domain.Env{StateDir: filepath.Join(n.stateDir, string(got.UID))}
	for _, c := range []struct{ volume, file, want string }{
		{"app", "/app.conf", "port=8080\n"},
		{"app", "/blob.bin", "\x00\x01\x02\xff"},
		{"creds", "/token", "s3cret"},
	} {
		out, err := exec.Command("isoinfo", "-R", "-i", env.ConfigDiskPath(c.volume), "-x", c.file).Output()
		if err != nil {
			t.Errorf("volume %s: isoinfo %s: %v", c.volume, c.file, err)
			continue
		}
		if string(out) != c.want {
			t.Errorf("volume %s: %s = %q, want %q", c.volume, c.file, out, c.want)
		}
	}
	out, err := exec.Command("isoinfo", "-R", "-f", "-i", env.ConfigDiskPath("extra")).Output()
	if err != nil {
		t.Errorf("optional volume: %v", err)
	} else if len(out) != 0 {
		t.Errorf("the missing optional ConfigMap's disk lists %q, want nothing", out)
	}
}
