package containerdisk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry/registrytest"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/nodeagent/importer"
	"github.com/nodevirt/nodevirt/test/guest"
)

// guestDisk is the test guest's boot disk: the raw image and its qcow2.
func guestDisk(t *testing.T) (raw string, qcow2 []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	raw, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		t.Fatalf("test guest boot disk: %v", err)
	}
	q, err := guest.QCOW2(ctx, raw)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(q)
	if err != nil {
		t.Fatal(err)
	}
	return raw, b
}

func wantPullError(t *testing.T, err error, reason string, cause importer.Reason) *PullError {
	t.Helper()
	var pe *PullError
	if !errors.As(err, &pe) {
		t.Fatalf("got %v, want a *PullError", err)
	}
	if pe.Reason != reason || pe.Cause != cause {
		t.Fatalf("got reason %s cause %q (%v), want %s cause %q", pe.Reason, pe.Cause, err, reason, cause)
	}
	return pe
}

func TestPuller(t *testing.T) {
	raw, qcow2 := guestDisk(t)
	rawSHA := dvimporttest.SHA256(t, raw)
	reg := registrytest.New()
	host, stop := reg.Serve()
	defer stop()
	insecure := []string{host}
	// The test registry listens on loopback, which pulls may not reach
	// unless the CDI CR allows it.
	loopback := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	publish := func(repo, tag string, files map[string][]byte) (manifest, layer string) {
		t.Helper()
		m, l, err := reg.Publish(repo, tag, files)
		if err != nil {
			t.Fatal(err)
		}
		return m, l
	}

	v1Digest, v1Layer := publish("kubevirt/guest", "v1", map[string][]byte{"disk/guest.qcow2": qcow2})
	if latest, _ := publish("kubevirt/guest", "latest", map[string][]byte{"disk/guest.qcow2": qcow2}); latest != v1Digest {
		t.Fatalf("publishing the same image twice gave two digests")
	}
	publish("kubevirt/custom", "v1", map[string][]byte{
		"disk/decoy.img": []byte("decoy"), "custom/boot.qcow2": qcow2})
	publish("kubevirt/nodisk", "v1", map[string][]byte{"etc/hostname": []byte("x\n")})

	dir := t.TempDir()
	// A pull a crash interrupted.
	os.MkdirAll(filepath.Join(dir, tmpDir, "pull-123"), 0o755)
	os.WriteFile(filepath.Join(dir, tmpDir, "pull-123", diskFile), []byte("half"), 0o644)
	p, err := New(Config{Dir: dir, Backoff: 300 * time.Millisecond, MaxBackoff: time.Second, KeepUnused: -1})
	if err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, tmpDir)); len(ents) != 0 {
		t.Errorf("New left %d entries of interrupted pulls", len(ents))
	}
	ctx := context.Background()
	image := host + "/kubevirt/guest:v1"

	var first Image
	t.Run("pull in the background", func(t *testing.T) {
		done := make(chan struct{})
		t0 := time.Now()
		_, err := p.Acquire(ctx, Request{Image: image, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-a", func() { close(done) })
		if !errors.Is(err, ErrPulling) {
			t.Fatalf("first acquire: %v, want ErrPulling", err)
		}
		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			t.Fatal("pull did not finish")
		}
		if first, err = p.Acquire(ctx, Request{Image: image, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-a", nil); err != nil {
			t.Fatal(err)
		}
		t.Logf("pulled %d bytes of qcow2 (gz layer %d bytes) into a %d-byte raw disk in %s",
			len(qcow2), len(reg.Blob(v1Layer)), first.VirtualSize, time.Since(t0).Round(time.Millisecond))
		if first.Digest != v1Digest {
			t.Errorf("digest %s, want %s", first.Digest, v1Digest)
		}
		if got := dvimporttest.SHA256(t, first.Path); got != rawSHA {
			t.Errorf("cached disk %s differs from the guest's boot disk %s", got, rawSHA)
		}
		if first.VirtualSize != 64<<20 {
			t.Errorf("virtual size %d", first.VirtualSize)
		}
		st, err := os.Stat(first.Path)
		if err != nil || st.Mode().Perm() != 0o644 {
			t.Errorf("cached disk mode %v (%v), want 0644", st.Mode(), err)
		}
	})

	t.Run("cache hit without the network", func(t *testing.T) {
		before := reg.BlobGets(v1Layer)
		t0 := time.Now()
		img, err := p.Pull(ctx, Request{Image: image, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-b")
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("cache hit in %s", time.Since(t0).Round(time.Microsecond))
		if img.Path != first.Path || reg.BlobGets(v1Layer) != before {
			t.Errorf("second pull: path %s (want %s), layer fetched %d more times", img.Path, first.Path, reg.BlobGets(v1Layer)-before)
		}
		// Never is fine once the image is here, and the registry is not asked.
		srvOff := Request{Image: image, PullPolicy: k8sv1.PullNever}
		if img, err := p.Pull(ctx, srvOff, "vmi-b"); err != nil || img.Path != first.Path {
			t.Errorf("never with a cached image: %v %v", img, err)
		}
		imgs, err := p.Images()
		if err != nil || len(imgs) != 1 || strings.Join(imgs[first], ",") != "vmi-a,vmi-b" {
			t.Errorf("images %v, %v", imgs, err)
		}
	})

	t.Run("concurrent pulls of one image download it once", func(t *testing.T) {
		d, layer := publish("kubevirt/guest", "v2", map[string][]byte{"disk/guest.qcow2": qcow2, "etc/version": []byte("v2")})
		var wg sync.WaitGroup
		paths := make([]string, 3)
		for i := range paths {
			wg.Go(func() {
				img, err := p.Pull(ctx, Request{Image: host + "/kubevirt/guest:v2", InsecureRegistries: insecure, AllowedNetworks: loopback}, fmt.Sprint("vmi-c", i))
				if err != nil {
					t.Error(err)
				}
				if img.Digest != d {
					t.Errorf("digest %s, want %s", img.Digest, d)
				}
				paths[i] = img.Path
			})
		}
		wg.Wait()
		if n := reg.BlobGets(layer); n != 1 {
			t.Errorf("layer downloaded %d times, want 1", n)
		}
		if paths[0] != paths[1] || paths[1] != paths[2] {
			t.Errorf("paths %v", paths)
		}
	})

	t.Run("policy Always follows a moved tag", func(t *testing.T) {
		latest := host + "/kubevirt/guest" // no tag: latest, policy Always
		img, err := p.Pull(ctx, Request{Image: latest, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-d")
		if err != nil {
			t.Fatal(err)
		}
		if img.Path != first.Path {
			t.Errorf("latest was v1: path %s, want %s", img.Path, first.Path)
		}
		other := bytes.Repeat([]byte("nodevirt second image\n"), 1<<16)
		moved, _ := publish("kubevirt/guest", "latest", map[string][]byte{"disk/disk.img": other})
		img, err = p.Pull(ctx, Request{Image: latest, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-d")
		if err != nil {
			t.Fatal(err)
		}
		if img.Digest != moved || img.Path == first.Path {
			t.Fatalf("after the tag moved: digest %s path %s, want %s and a new path", img.Digest, img.Path, moved)
		}
		if b, err := os.ReadFile(img.Path); err != nil || !bytes.Equal(b, other) {
			t.Errorf("new image content differs (%v)", err)
		}
		// IfNotPresent keeps what the node has for that name.
		img, err = p.Pull(ctx, Request{Image: latest, PullPolicy: k8sv1.PullIfNotPresent, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-e")
		if err != nil || img.Digest != moved {
			t.Errorf("IfNotPresent after the Always pull: %s %v, want %s", img.Digest, err, moved)
		}
		if _, err := os.Stat(first.Path); err != nil {
			t.Errorf("the old image still in use went away: %v", err)
		}
	})

	t.Run("path inside the image", func(t *testing.T) {
		img, err := p.Pull(ctx, Request{Image: host + "/kubevirt/custom:v1", Path: "/custom/boot.qcow2", InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-f")
		if err != nil {
			t.Fatal(err)
		}
		if got := dvimporttest.SHA256(t, img.Path); got != rawSHA {
			t.Errorf("disk at the path is not the guest's boot disk")
		}
		_, err = p.Pull(ctx, Request{Image: host + "/kubevirt/custom:v1", Path: "/custom/none.img", InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-f")
		wantPullError(t, err, ReasonErrImagePull, importer.ReasonInvalidImage)
	})

	t.Run("hostile disks are refused", func(t *testing.T) {
		// A VMDK descriptor whose FLAT extent is the host's /etc/passwd, and
		// a qcow2 whose backing file is.
		vmdk := []byte("# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 4 FLAT \"/etc/passwd\" 0\n")
		qcowPath := filepath.Join(t.TempDir(), "backing.qcow2")
		if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "raw", "-b", "/etc/passwd", qcowPath, "16M").CombinedOutput(); err != nil {
			t.Fatalf("qemu-img create: %v: %s", err, out)
		}
		backing, err := os.ReadFile(qcowPath)
		if err != nil {
			t.Fatal(err)
		}
		for repo, disk := range map[string][]byte{"evil/vmdk": vmdk, "evil/qcow2": backing} {
			publish(repo, "v1", map[string][]byte{"disk/disk.img": disk})
			_, err := p.Pull(ctx, Request{Image: host + "/" + repo + ":v1", InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-evil")
			pe := wantPullError(t, err, ReasonErrImagePull, importer.ReasonUnsupportedImage)
			if !strings.Contains(pe.Error(), "/etc/passwd") {
				t.Errorf("%s: message %q does not name the host file", repo, pe.Error())
			}
		}
		imgs, err := p.Images()
		if err != nil {
			t.Fatal(err)
		}
		for img := range imgs {
			if strings.Contains(img.Reference, "evil/") {
				t.Errorf("refused image %s is cached", img.Reference)
			}
		}
	})

	t.Run("loopback needs the allowance", func(t *testing.T) {
		_, err := p.Pull(ctx, Request{Image: host + "/kubevirt/unreachable:v1", InsecureRegistries: insecure}, "vmi-noreach")
		wantPullError(t, err, ReasonErrImagePull, importer.ReasonNetworkNotAllowed)
	})

	t.Run("no disk in the image", func(t *testing.T) {
		_, err := p.Pull(ctx, Request{Image: host + "/kubevirt/nodisk:v1", InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-g")
		pe := wantPullError(t, err, ReasonErrImagePull, importer.ReasonInvalidImage)
		if !strings.Contains(pe.Error(), "no file under /disk/") || !strings.Contains(pe.Error(), "kubevirt/nodisk:v1") {
			t.Errorf("message %q does not say what is missing where", pe.Error())
		}
	})

	t.Run("missing image, then back-off, then retry", func(t *testing.T) {
		req := Request{Image: host + "/kubevirt/later:v1", InsecureRegistries: insecure, AllowedNetworks: loopback}
		_, err := p.Pull(ctx, req, "vmi-h")
		wantPullError(t, err, ReasonErrImagePull, importer.ReasonSourceNotFound)
		_, err = p.Pull(ctx, req, "vmi-h")
		pe := wantPullError(t, err, ReasonImagePullBackOff, importer.ReasonSourceNotFound)
		if pe.RetryAt.IsZero() || !strings.Contains(pe.Error(), "404") {
			t.Errorf("back-off error %q", pe.Error())
		}
		publish("kubevirt/later", "v1", map[string][]byte{"disk/disk.qcow2": qcow2})
		time.Sleep(time.Until(pe.RetryAt))
		if _, err := p.Pull(ctx, req, "vmi-h"); err != nil {
			t.Errorf("after the back-off and the push: %v", err)
		}
	})

	t.Run("never pulls nothing", func(t *testing.T) {
		_, err := p.Pull(ctx, Request{Image: host + "/kubevirt/absent:v9", PullPolicy: k8sv1.PullNever}, "vmi-i")
		wantPullError(t, err, ReasonErrImageNeverPull, "")
	})

	t.Run("pull secret", func(t *testing.T) {
		reg.SetAuth("puller", "s3cret")
		defer reg.SetAuth("", "")
		d, _ := publish("private/guest", "v1", map[string][]byte{"disk/disk.qcow2": qcow2})
		req := Request{Image: host + "/private/guest:v1", InsecureRegistries: insecure, AllowedNetworks: loopback}
		_, err := p.Pull(ctx, req, "vmi-j")
		wantPullError(t, err, ReasonErrImagePull, importer.ReasonUnauthorized)

		p2, err := New(Config{Dir: t.TempDir()}) // no back-off memory
		if err != nil {
			t.Fatal(err)
		}
		req.PullSecret = registrytest.DockerConfigJSON(host, "puller", "wrong")
		_, err = p2.Pull(ctx, req, "vmi-j")
		wantPullError(t, err, ReasonErrImagePull, importer.ReasonUnauthorized)

		p3, err := New(Config{Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		req.PullSecret = registrytest.DockerConfigJSON("https://"+host+"/v1/", "puller", "s3cret")
		img, err := p3.Pull(ctx, req, "vmi-j")
		if err != nil {
			t.Fatalf("with the right secret: %v", err)
		}
		if img.Digest != d || dvimporttest.SHA256(t, img.Path) != rawSHA {
			t.Errorf("pulled %s, want %s with the guest disk", img.Digest, d)
		}
	})

	t.Run("release removes images nothing uses", func(t *testing.T) {
		if err := p.Release("vmi-a"); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(first.Path); err != nil {
			t.Fatalf("image still used by vmi-b was removed: %v", err)
		}
		for _, o := range []string{"vmi-b", "vmi-d", "vmi-e"} {
			if err := p.Release(o); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := os.Stat(first.Path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("unused image kept: %v", err)
		}
		if err := p.Release("vmi-a"); err != nil {
			t.Errorf("releasing again: %v", err)
		}
		// The next pull of that name fetches it again.
		before := reg.BlobGets(v1Layer)
		if _, err := p.Pull(ctx, Request{Image: image, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-k"); err != nil {
			t.Fatal(err)
		}
		if reg.BlobGets(v1Layer) != before+1 {
			t.Errorf("pull after removal did not download")
		}
	})

	t.Run("retain forgets users that are gone", func(t *testing.T) {
		img, err := p.Pull(ctx, Request{Image: image, InsecureRegistries: insecure, AllowedNetworks: loopback}, "vmi-l")
		if err != nil {
			t.Fatal(err)
		}
		// vmi-k and vmi-l use it; a restarted agent knows only vmi-l.
		if err := p.Retain(func(o string) bool { return o == "vmi-l" }); err != nil {
			t.Fatal(err)
		}
		imgs, _ := p.Images()
		if got := strings.Join(imgs[img], ","); got != "vmi-l" {
			t.Errorf("users after retain: %q, want vmi-l", got)
		}
		if err := p.Retain(func(string) bool { return false }); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(img.Path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("image without users kept: %v", err)
		}
	})
}

func TestParseReference(t *testing.T) {
	for _, c := range []struct{ in, want, policy string }{
		{"quay.io/kubevirt/cirros-container-disk-demo", "quay.io/kubevirt/cirros-container-disk-demo:latest", "Always"},
		{"quay.io/containerdisks/fedora:40", "quay.io/containerdisks/fedora:40", "IfNotPresent"},
		{"fedora", "docker.io/library/fedora:latest", "Always"},
		{"kubevirt/fedora-cloud:35", "docker.io/kubevirt/fedora-cloud:35", "IfNotPresent"},
		{"127.0.0.1:5000/a/b:v1", "127.0.0.1:5000/a/b:v1", "IfNotPresent"},
		{"localhost/x@sha256:" + strings.Repeat("ab", 32), "localhost/x@sha256:" + strings.Repeat("ab", 32), "IfNotPresent"},
		{"registry:5000/x", "registry:5000/x:latest", "Always"},
	} {
		r, err := ParseReference(c.in)
		if err != nil || r.String() != c.want {
			t.Errorf("%s: %s, %v; want %s", c.in, r, err, c.want)
		}
		if got := DefaultPullPolicy(c.in); string(got) != c.policy {
			t.Errorf("%s: policy %s, want %s", c.in, got, c.policy)
		}
	}
	for _, bad := range []string{"", "docker://x/y", "x/Y", "x@sha256:12", "host.io/", "a//b", "x:"} {
		if _, err := ParseReference(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	user, pass, ok, err := Credentials(registrytest.DockerConfigJSON("https://index.docker.io/v1/", "u", "p:w"), "docker.io")
	if err != nil || !ok || user != "u" || pass != "p:w" {
		t.Errorf("docker hub credentials: %q %q %v %v", user, pass, ok, err)
	}
	if _, _, ok, _ := Credentials(registrytest.DockerConfigJSON("other.io", "u", "p"), "quay.io"); ok {
		t.Error("credentials of another registry matched")
	}
	if _, _, _, err := Credentials([]byte("{"), "quay.io"); err == nil {
		t.Error("a broken secret was accepted")
	}
}
