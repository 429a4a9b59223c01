package handler

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/subresources"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// osRelease parses an os-release file.
func osRelease(t *testing.T) map[string]string {
	t.Helper()
	text, err := guest.HostOSRelease()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			out[k] = strings.Trim(v, `"`)
		}
	}
	return out
}

// TestGuestAgent boots a guest running Debian's qemu-ga and checks what
// the handler makes of it: the AgentConnected condition, status.guestOSInfo
// and the guest's address on its bridge NIC, the console server's
// guestosinfo/userlist/filesystemlist answers from the live agent, the
// condition going when qemu-ga stops, and the guest powering off.
func TestGuestAgent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n := newNode(t)
	const guestIP = "10.231.0.5"
	n.bootVolumeOf(ctx, "boot", guest.DiskSpec{
		Cmdline: "nodevirt.ip=" + guestIP + "/24",
		Initramfs: guest.Spec{GuestAgent: true, Modules: []string{"ext4"},
			Init: "mkdir -p /boot && mount -t ext4 -o ro /dev/vda1 /boot"},
	})
	n.bridgeNetwork(ctx, "br")
	h, _ := n.handler(true)

	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "agent"},
		Spec: v1.VirtualMachineInstanceSpec{
			TerminationGracePeriodSeconds: int64p(30),
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("128Mi")}},
				Devices: v1.Devices{
					Disks: []v1.Disk{{Name: "boot", BootOrder: uintp(1), DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}}},
					Interfaces: []v1.Interface{{Name: "lan", MacAddress: testMAC,
						InterfaceBindingMethod: v1.InterfaceBindingMethod{Bridge: &v1.InterfaceBridge{}}}},
				},
			},
			Networks: []v1.Network{{Name: "lan", NetworkSource: v1.NetworkSource{Multus: &v1.MultusNetwork{NetworkName: "br"}}}},
			Volumes: []v1.Volume{{Name: "boot", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "boot"}}}}},
		},
	}
	start := time.Now()
	n.schedule(ctx, vmi)
	got := n.waitVMI(ctx, "agent", bootTimeout, "AgentConnected", func(v *v1.VirtualMachineInstance) bool {
		return isTrue(v, v1.VirtualMachineInstanceAgentConnected)
	})
	t.Logf("create → AgentConnected in %v (TCG)", time.Since(start).Round(time.Millisecond))

	// status.guestOSInfo comes with (or right after) the condition.
	got = n.waitVMI(ctx, "agent", 30*time.Second, "with guestOSInfo and the guest's address", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.GuestOSInfo.ID != "" && len(v.Status.Interfaces) == 1 && v.Status.Interfaces[0].IP != ""
	})
	if c := condition(got, v1.VirtualMachineInstanceUnsupportedAgent); c != nil {
		t.Errorf("Debian's qemu-ga judged unsupported: %+v", c)
	}
	rel := osRelease(t)
	_, modulesDir, err := guest.Kernel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := v1.VirtualMachineInstanceGuestOSInfo{ID: rel["ID"], Name: rel["NAME"], PrettyName: rel["PRETTY_NAME"],
		Version: rel["VERSION"], VersionID: rel["VERSION_ID"], KernelRelease: filepath.Base(modulesDir), Machine: "x86_64"}
	os := got.Status.GuestOSInfo
	if os.KernelVersion == "" {
		t.Errorf("guestOSInfo without kernelVersion: %+v", os)
	}
	os.KernelVersion = ""
	if os != want {
		t.Errorf("guestOSInfo %+v, want %+v", os, want)
	}
	iface := got.Status.Interfaces[0]
	if iface.IP != guestIP || !slices.Equal(iface.IPs, []string{guestIP}) || iface.InterfaceName != "eth0" ||
		iface.MAC != testMAC || !strings.Contains(iface.InfoSource, "guest-agent") {
		t.Errorf("interface status %+v, want %s on eth0 from the guest agent", iface, guestIP)
	}

	// The console server's answers, from live agent calls.
	c := n.consoleClient(h)
	var info v1.VirtualMachineInstanceGuestAgentInfo
	if err := c.GuestAgent(ctx, n.ns, "agent", "guestosinfo", &info); err != nil {
		t.Fatal(err)
	}
	if info.GAVersion == "" || info.Hostname != "nodevirt-guest" || info.OS.ID != rel["ID"] || len(info.SupportedCommands) == 0 ||
		len(info.UserList) != 1 || info.Timezone == "" {
		t.Errorf("guestosinfo %+v", info)
	}
	var users v1.VirtualMachineInstanceGuestOSUserList
	if err := c.GuestAgent(ctx, n.ns, "agent", "userlist", &users); err != nil {
		t.Fatal(err)
	}
	if len(users.Items) != 1 || users.Items[0].UserName != "root" || int64(users.Items[0].LoginTime) != guest.AgentLoginTime {
		t.Errorf("userlist %+v, want root since %d", users.Items, guest.AgentLoginTime)
	}
	var fss v1.VirtualMachineInstanceFileSystemList
	if err := c.GuestAgent(ctx, n.ns, "agent", "filesystemlist", &fss); err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(fss.Items, func(f v1.VirtualMachineInstanceFileSystem) bool { return f.MountPoint == "/boot" })
	if i < 0 || fss.Items[i].DiskName != "vda1" || fss.Items[i].TotalBytes <= 0 || fss.Items[i].UsedBytes <= 0 {
		t.Errorf("filesystemlist %+v, want /boot on vda1 with its usage", fss.Items)
	}

	// The brain's own node client (clusterbrain/subresources) reads the
	// same answers, finding this node's server through its Node object.
	tc, err := n.pki.ClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	nodeObj := &k8sv1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name,
		Annotations: map[string]string{identity.NodeAddressAnnotation: h.ConsoleAddr()}}}
	if _, err := n.kube.CoreV1().Nodes().Create(ctx, nodeObj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.kube.CoreV1().Nodes().Delete(context.Background(), n.name, metav1.DeleteOptions{}) })
	brain := subresources.NewHTTPSNodeClient(n.kube, tc)
	for _, what := range []string{"guestosinfo", "userlist", "filesystemlist"} {
		data, err := brain.Call(ctx, got, http.MethodGet, what, nil)
		if err != nil {
			t.Fatalf("brain client %s: %v", what, err)
		}
		var anyJSON map[string]any
		if err := json.Unmarshal(data, &anyJSON); err != nil || len(anyJSON) == 0 {
			t.Errorf("brain client %s: %q %v", what, data, err)
		}
	}

	// The freeze subresource's call: the guest's file systems freeze, and
	// the node thaws them by itself after the body's unfreezeTimeout.
	fsStatus := func() string {
		var st string
		if err := n.lv.AgentCommand(ctx, n.ns+"_agent", "guest-fsfreeze-status", nil, &st); err != nil {
			t.Fatalf("guest-fsfreeze-status: %v", err)
		}
		return st
	}
	if _, err := brain.Call(ctx, got, http.MethodPut, "freeze", []byte(`{"unfreezeTimeout":"10s"}`)); err != nil {
		t.Fatalf("brain client freeze: %v", err)
	}
	frozenAt := time.Now()
	if st := fsStatus(); st != "frozen" {
		t.Errorf("after freeze the guest says %q", st)
	}
	testkit.Poll(t, 60*time.Second, "the guest thawed after its unfreezeTimeout", func() (bool, error) {
		st := fsStatus()
		return st == "thawed", fmt.Errorf("guest-fsfreeze-status %q", st)
	})
	if d := time.Since(frozenAt); d < 5*time.Second {
		t.Errorf("thawed after %v, well before the 10 s unfreezeTimeout", d)
	}

	// qemu-ga stops: the condition goes while the guest runs on, and the
	// node refuses agent calls with a conflict.
	con, err := c.Console(ctx, n.ns, "agent")
	if err != nil {
		t.Fatal(err)
	}
	defer con.Close()
	fmt.Fprintf(con, "\nkill $(pidof qemu-ga)\n")
	n.waitVMI(ctx, "agent", 30*time.Second, "Running without AgentConnected", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Running && condition(v, v1.VirtualMachineInstanceAgentConnected) == nil
	})
	if err := c.GuestAgent(ctx, n.ns, "agent", "userlist", &users); !errors.Is(err, console.ErrNoGuestAgent) {
		t.Errorf("userlist without agent: %v, want ErrNoGuestAgent", err)
	}
	if _, err := brain.Call(ctx, got, http.MethodGet, "userlist", nil); !apierrors.IsConflict(err) {
		t.Errorf("brain client userlist without agent: %v, want a conflict", err)
	}

	// The agent comes back, then the guest powers off: Succeeded, no
	// AgentConnected.
	fmt.Fprintf(con, "/usr/sbin/qemu-ga -m virtio-serial -p /dev/virtio-ports/%s -t /run/qemu-ga &\n", guest.GuestAgentPort)
	n.waitVMI(ctx, "agent", 30*time.Second, "AgentConnected again", func(v *v1.VirtualMachineInstance) bool {
		return isTrue(v, v1.VirtualMachineInstanceAgentConnected)
	})
	fmt.Fprintf(con, "poweroff\n")
	n.waitVMI(ctx, "agent", 60*time.Second, "Succeeded without AgentConnected", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Succeeded && condition(v, v1.VirtualMachineInstanceAgentConnected) == nil
	})
}
