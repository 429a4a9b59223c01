package handler

import (
	"strings"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/launcher"
)

// TestMigratingAway: a source domain that left by migration (shut off or
// paused for the switchover, or known to have left) is no news for the VMI;
// other stops are.
func TestMigratingAway(t *testing.T) {
	h := &Handler{migratedAway: map[types.UID]bool{"gone": true}}
	vmi := &v1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{UID: "u1"}}
	for _, c := range []struct {
		info  launcher.DomainInfo
		found bool
		want  bool
	}{
		{launcher.DomainInfo{State: launcher.StateShutoff, Reason: "migrated"}, true, true},
		{launcher.DomainInfo{State: launcher.StatePaused, Reason: "migration"}, true, true},
		{launcher.DomainInfo{State: launcher.StateShutoff, Reason: "shutdown"}, true, false},
		{launcher.DomainInfo{State: launcher.StatePaused, Reason: "user"}, true, false},
		{launcher.DomainInfo{}, false, false},
	} {
		if got := h.migratingAway(vmi, c.info, c.found); got != c.want {
			t.Errorf("%+v found %v: %v, want %v", c.info, c.found, got, c.want)
		}
	}
	gone := &v1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{UID: "gone"}}
	if !h.migratingAway(gone, launcher.DomainInfo{}, false) {
		t.Error("a VMI whose guest left is not migrating away")
	}
}

// TestReceivableAndCopyable: what a node can receive and copy.
func TestReceivableAndCopyable(t *testing.T) {
	h := &Handler{}
	yes, no := true, false
	spec := func(vols ...v1.Volume) *v1.VirtualMachineInstance {
		return &v1.VirtualMachineInstance{Spec: v1.VirtualMachineInstanceSpec{Volumes: vols}}
	}
	hd := func(shared *bool) v1.Volume {
		return v1.Volume{Name: "hd", VolumeSource: v1.VolumeSource{HostDisk: &v1.HostDisk{Path: "/x", Shared: shared}}}
	}
	for _, c := range []struct {
		vmi  *v1.VirtualMachineInstance
		want bool
	}{
		{spec(hd(&yes)), true},
		{spec(hd(&no)), false},
		{spec(hd(nil)), false},
		{spec(v1.Volume{Name: "cd", VolumeSource: v1.VolumeSource{ContainerDisk: &v1.ContainerDiskSource{Image: "i"}}}), false},
		{&v1.VirtualMachineInstance{Spec: v1.VirtualMachineInstanceSpec{Networks: []v1.Network{*v1.DefaultPodNetwork()}}}, false},
	} {
		if ok, why := h.receivable(c.vmi); ok != c.want {
			t.Errorf("%+v: receivable %v (%s), want %v", c.vmi.Spec, ok, why, c.want)
		}
	}
	block := k8sv1.PersistentVolumeBlock
	csiPV := func(driver string, mode *k8sv1.PersistentVolumeMode) *k8sv1.PersistentVolume {
		return &k8sv1.PersistentVolume{Spec: k8sv1.PersistentVolumeSpec{VolumeMode: mode,
			PersistentVolumeSource: k8sv1.PersistentVolumeSource{CSI: &k8sv1.CSIPersistentVolumeSource{Driver: driver}}}}
	}
	if why := copyable(csiPV("kubevirt.io.hostpath-provisioner", nil)); why != "" {
		t.Errorf("hostpath filesystem volume: %s", why)
	}
	if copyable(csiPV("other.csi", nil)) == "" || copyable(csiPV("kubevirt.io.hostpath-provisioner", &block)) == "" ||
		copyable(&k8sv1.PersistentVolume{}) == "" {
		t.Error("a volume nodevirt cannot copy is copyable")
	}
}

// TestCompletionTimeout: KubeVirt's per-GiB budget over memory and copied
// disks, plus the setup allowance.
func TestCompletionTimeout(t *testing.T) {
	vmi := &v1.VirtualMachineInstance{Spec: v1.VirtualMachineInstanceSpec{Domain: v1.DomainSpec{Resources: v1.ResourceRequirements{
		Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("1Gi")}}}}}
	per := int64(20)
	conf := &v1.VMIMConfigurationOptions{CompletionTimeoutPerGiB: &per}
	if got := completionTimeout(vmi, conf, 1<<30); got != 50*time.Second {
		t.Errorf("1 GiB + 1 GiB at 20 s/GiB: %s", got)
	}
	if got := completionTimeout(vmi, nil, 0); got != 160*time.Second {
		t.Errorf("1 GiB at the default 150 s/GiB: %s", got)
	}
}

// TestMigrationURI: the target's libvirtd by transport, IPv6 bracketed.
func TestMigrationURI(t *testing.T) {
	h := &Handler{cfg: Config{MigrationTransport: TransportTCP}}
	if got := h.migrationURI("10.0.0.2"); got != "qemu+tcp://10.0.0.2/system" {
		t.Error(got)
	}
	h.cfg.MigrationTransport = TransportTLS
	if got := h.migrationURI("fd00::2"); got != "qemu+tls://[fd00::2]/system" {
		t.Error(got)
	}
	// The node certificate's files for the source's libvirtd.
	h.cfg.MigrationPKIDir = "/var/lib/nodevirt/libvirt-pki"
	if got := h.migrationURI("10.0.0.2"); got != "qemu+tls://10.0.0.2/system?pkipath=/var/lib/nodevirt/libvirt-pki" {
		t.Error(got)
	}
	h.cfg.MigrationTransport = TransportTCP
	if got := h.migrationURI("10.0.0.2"); got != "qemu+tcp://10.0.0.2/system" {
		t.Error(got)
	}
	// Only plain absolute paths: libvirt reads the query unescaped.
	for dir, ok := range map[string]bool{"/var/lib/nodevirt/libvirt-pki": true, "relative/pki": false, "/a b": false, "/x?y": false, "/x&y": false} {
		err := (&Config{MigrationPKIDir: dir}).validate()
		if refused := err != nil && strings.Contains(err.Error(), "pki dir"); refused == ok {
			t.Errorf("pki dir %q: %v", dir, err)
		}
	}
}

// TestPostCopyOnlyWhenAllowed: allowPostCopy switches at the completion
// timeout instead of aborting there; without it nothing switches.
func TestPostCopyOnlyWhenAllowed(t *testing.T) {
	yes, no := true, false
	const limit = 40 * time.Second
	for _, c := range []struct {
		conf               *v1.VMIMConfigurationOptions
		postCopy, deadline time.Duration
	}{
		{nil, 0, limit},
		{&v1.VMIMConfigurationOptions{}, 0, limit},
		{&v1.VMIMConfigurationOptions{AllowPostCopy: &no}, 0, limit},
		{&v1.VMIMConfigurationOptions{AllowPostCopy: &yes}, limit, 2 * limit},
	} {
		if p, d := migrationDeadlines(c.conf, limit); p != c.postCopy || d != c.deadline {
			t.Errorf("%+v: post-copy after %s, deadline %s; want %s, %s", c.conf, p, d, c.postCopy, c.deadline)
		}
	}
}
