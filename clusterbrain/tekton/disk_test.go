package tekton

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/guest"
)

// guestfsKernel points libguestfs (supermin) at the test guests' Debian
// cloud kernel: this machine's own kernel has no image in /boot. The
// module tree gets its modules.dep (dpkg -x runs no depmod) in a copy,
// and the appliance is cached between runs. libguestfs runs QEMU under
// TCG (KVM hangs here).
func guestfsKernel(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"virt-customize", "virt-sysprep", "debugfs", "mkfs.ext4", "depmod"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s (make deps: libguestfs-tools, e2fsprogs, kmod): %v", tool, err)
		}
	}
	vmlinuz, modules, err := guest.Kernel(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	version := filepath.Base(modules)
	root := filepath.Join(guest.CacheDir(), "guestfs-kernel-"+version)
	if _, err := os.Stat(filepath.Join(root, "lib", "modules", version, "modules.dep")); err != nil {
		tmp := root + ".tmp"
		_ = os.RemoveAll(tmp)
		if err := os.MkdirAll(filepath.Join(tmp, "lib", "modules"), 0o755); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("cp", "-a", modules, filepath.Join(tmp, "lib", "modules", version)).CombinedOutput(); err != nil {
			t.Fatalf("copy modules: %v %s", err, out)
		}
		if out, err := exec.Command("depmod", "-b", tmp, version).CombinedOutput(); err != nil {
			t.Fatalf("depmod: %v %s", err, out)
		}
		_ = os.RemoveAll(root)
		if err := os.Rename(tmp, root); err != nil {
			t.Fatal(err)
		}
	}
	// supermin walks the host's /lib/modules while it copies the modules.
	if err := os.MkdirAll("/lib/modules", 0o755); err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(guest.CacheDir(), "guestfs-appliance")
	if err := os.MkdirAll(cache, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SUPERMIN_KERNEL", vmlinuz)
	t.Setenv("SUPERMIN_MODULES", filepath.Join(root, "lib", "modules", version))
	t.Setenv("LIBGUESTFS_CACHEDIR", cache)
	t.Setenv("LIBGUESTFS_BACKEND_SETTINGS", "force_tcg")
	t.Setenv("LIBGUESTFS_MEMSIZE", "768")
}

// linuxDisk makes an ext4 disk image holding a minimal Debian root
// (enough for libguestfs' inspection, busybox as /bin/sh).
func linuxDisk(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	files := map[string]string{
		"etc/os-release":     "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nNAME=\"Debian GNU/Linux\"\nVERSION_ID=\"12\"\nID=debian\n",
		"etc/debian_version": "12.0\n",
		"etc/fstab":          "/dev/sda / ext4 defaults 0 1\n",
		"etc/machine-id":     "0123456789abcdef0123456789abcdef\n",
		"etc/hostname":       "guest\n",
	}
	for _, d := range []string{"etc", "bin", "usr/bin", "var/log", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for p, c := range files {
		if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("cp", "/bin/busybox", filepath.Join(root, "bin", "busybox")).CombinedOutput(); err != nil {
		t.Fatalf("busybox: %v %s", err, out)
	}
	if err := os.Symlink("busybox", filepath.Join(root, "bin", "sh")); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(dir, "disk.img")
	if err := os.Truncate(img, 0); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if out, err := exec.Command("mkfs.ext4", "-q", "-d", root, img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v %s", err, out)
	}
	return img
}

// catFile reads a file from the image's filesystem without libguestfs.
func catFile(t *testing.T, img, path string) string {
	t.Helper()
	out, err := exec.Command("debugfs", "-R", "cat "+path, img).Output()
	if err != nil {
		t.Fatalf("debugfs cat %s: %v", path, err)
	}
	return string(out)
}

func TestDiskVirtCustomizeAndSysprep(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	guestfsKernel(t)
	img := linuxDisk(t)
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "rootdisk", Namespace: e.ns},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}}}}
	if _, err := e.c.Kube.CoreV1().PersistentVolumeClaims(e.ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// A claim a running VMI uses is refused before libguestfs runs.
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "user", Namespace: e.ns},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{Volumes: []kubevirtv1.Volume{{Name: "root",
			VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "rootdisk"}}}}}}}
	got, err := e.c.Virt.VMIs.Create(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	got.Status.Phase = kubevirtv1.Running
	if _, err := e.c.Virt.VMIs.UpdateStatus(ctx, got); err != nil {
		t.Fatal(err)
	}
	if out := e.run(t, 1, "disk-virt-customize", "--pvc=rootdisk", "--disk="+img, "--virtCommands=write /etc/motd:x"); !strings.Contains(out, "in use by the VMI user") {
		t.Errorf("a claim in use: %s", out)
	}
	if err := e.c.Virt.VMIs.Delete(ctx, e.ns, "user", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	e.run(t, 0, "disk-virt-customize", "--pvc=rootdisk", "--disk="+img,
		"--virtCommands=write /etc/motd:hello from the task\nmkdir /opt/app\nrun-command echo ran > /opt/app/ran\n")
	if got := catFile(t, img, "/etc/motd"); got != "hello from the task" {
		t.Errorf("/etc/motd after virt-customize: %q", got)
	}
	if got := catFile(t, img, "/opt/app/ran"); got != "ran\n" {
		t.Errorf("run-command's output: %q", got)
	}
	// A command that fails fails the task.
	e.run(t, 1, "disk-virt-customize", "--pvc=rootdisk", "--disk="+img, "--virtCommands=run-command exit 7")

	// virt-sysprep resets the machine identity (its customize step then
	// writes a fresh one) and runs its customize commands.
	e.run(t, 0, "disk-virt-sysprep", "--pvc=rootdisk", "--disk="+img, "--virtCommands=write /etc/sysprepped:yes",
		"--additionalVirtOptions=--operations machine-id,customize")
	if got := catFile(t, img, "/etc/machine-id"); strings.TrimSpace(got) == "0123456789abcdef0123456789abcdef" {
		t.Errorf("machine-id after virt-sysprep: %q", got)
	}
	if got := catFile(t, img, "/etc/sysprepped"); got != "yes" {
		t.Errorf("sysprep's customize command: %q", got)
	}
	if got := catFile(t, img, "/etc/motd"); got != "hello from the task" {
		t.Errorf("sysprep touched /etc/motd: %q", got)
	}
	if out := e.run(t, 1, "disk-virt-customize", "--pvc=absent", "--disk="+img, "--virtCommands=write /x:y"); !strings.Contains(out, "not found") {
		t.Errorf("an absent claim: %s", out)
	}
}
