package handler

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/nodeagent/podnet"
	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// dhcpUserData asks for an address with busybox udhcpc; its script
// configures the address, prints the lease and pings the gateway.
const dhcpUserData = `#!/bin/sh
cat >/run/lease.sh <<'EOF'
#!/bin/sh
[ "$1" = bound ] || exit 0
ip addr flush dev "$interface"
ip addr add "$ip/$mask" dev "$interface"
echo "PODNET-LEASE $ip/$mask gw $router host $hostname"
ping -c 2 -W 3 "$router" >/dev/null && echo PODNET-PING-$((40+2))
exit 0
EOF
chmod +x /run/lease.sh
udhcpc -i eth0 -n -q -t 5 -T 3 -s /run/lease.sh
`

// podnetConfig is a pod network of the test's own: a bridge and a /24 no
// other test or host route uses.
func podnetConfig(t *testing.T) podnet.Config {
	return podnet.Config{
		Bridge:     fmt.Sprintf("nvpn%05d", rand.IntN(100000)),
		CIDR:       fmt.Sprintf("10.%d.%d.0/24", 200+rand.IntN(50), rand.IntN(256)),
		StateDir:   t.TempDir(),
		ResolvConf: "/nonexistent",
		Log:        slog.New(slog.NewTextHandler(testWriter{t}, nil)).With("podnet", "test"),
	}
}

// hostPodnet sets up the test's pod network in the host's network
// namespace, where libvirtd opens taps: a bridge and nftables tables of
// its own, beside any other pod network of this host (a lab's or the
// end-to-end suite's nodeagent).
type hostPodnet struct {
	t   *testing.T
	cfg podnet.Config
	// forward is net.ipv4.ip_forward before the test, empty when another
	// pod network already ran: the value from before nodevirt is then
	// unknown (that network may go and restore it during the test).
	forward string
}

func newHostPodnet(t *testing.T) *hostPodnet {
	t.Helper()
	p := &hostPodnet{t: t, cfg: podnetConfig(t)}
	if !otherPodnets() {
		fwd, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
		if err != nil {
			t.Fatal(err)
		}
		p.forward = strings.TrimSpace(string(fwd))
	}
	t.Cleanup(p.remove)
	return p
}

// otherPodnets tells whether a pod network's nftables table exists in the
// host's namespace.
func otherPodnets() bool {
	tables, _ := exec.Command("nft", "list", "tables", "inet").Output()
	return strings.Contains(string(tables), "nodevirt_podnet_")
}

// start makes (or repairs, for a restart) the network and serves DHCP on
// it until stop is called.
func (p *hostPodnet) start(ctx context.Context) (pn *podnet.Network, stop func()) {
	t := p.t
	t.Helper()
	var err error
	for range 5 {
		if pn, err = podnet.New(p.cfg); err != nil {
			t.Fatal(err)
		}
		if err = pn.Ensure(ctx); err == nil || !strings.Contains(err.Error(), "overlaps") {
			break
		}
		// Another network of this host holds the subnet: pick another.
		p.cfg.CIDR = fmt.Sprintf("10.%d.%d.0/24", 200+rand.IntN(50), rand.IntN(256))
	}
	if err != nil {
		t.Fatalf("ensure pod network: %v", err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- pn.Run(runCtx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("dhcp server: %v", err)
		}
	}
	t.Cleanup(stop)
	return pn, stop
}

// remove takes the network away. Forwarding must be back as found unless
// another pod network of the host still needs it.
func (p *hostPodnet) remove() {
	t := p.t
	ctx := context.Background()
	pn, err := podnet.New(p.cfg)
	if err == nil {
		err = pn.Teardown(ctx)
	}
	if err != nil {
		t.Errorf("pod network teardown: %v", err)
	}
	if fwd, _ := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); p.forward != "" && !otherPodnets() && strings.TrimSpace(string(fwd)) != p.forward {
		t.Errorf("net.ipv4.ip_forward is %s after the teardown, was %s", strings.TrimSpace(string(fwd)), p.forward)
	}
	if _, err := netlink.LinkByName(p.cfg.Bridge); err == nil {
		t.Errorf("pod network bridge %s outlived the test", p.cfg.Bridge)
	}
}

// guardedTaps lists the taps in podnet's anti-spoofing map.
func guardedTaps(t *testing.T, bridge string) string {
	t.Helper()
	out, err := exec.Command("nft", "list", "map", "bridge", podnet.TableName(bridge), "taps").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list map: %v: %s", err, out)
	}
	return string(out)
}

// podVMI boots the test guest from the PVC boot on the pod network with
// the masquerade binding and no MAC (as KubeVirt's minimal manifests,
// without the brain's MAC pool), with user data from the Secret seed.
func podVMI(name string) *v1.VirtualMachineInstance {
	paused := v1.StartStrategyPaused
	return &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.VirtualMachineInstanceSpec{
			StartStrategy:                 &paused,
			TerminationGracePeriodSeconds: int64p(30),
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("128Mi")}},
				Devices: v1.Devices{
					Disks: []v1.Disk{
						{Name: "boot", BootOrder: uintp(1), DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
						{Name: "seed", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
					},
					Interfaces: []v1.Interface{{Name: "default",
						InterfaceBindingMethod: v1.InterfaceBindingMethod{Masquerade: &v1.InterfaceMasquerade{}}}},
				},
			},
			Networks: []v1.Network{*v1.DefaultPodNetwork()},
			Volumes: []v1.Volume{
				{Name: "boot", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
					PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "boot"}}}},
				{Name: "seed", VolumeSource: v1.VolumeSource{CloudInitNoCloud: &v1.CloudInitNoCloudSource{
					UserDataSecretRef: &k8sv1.LocalObjectReference{Name: "seed"}}}},
			},
		},
	}
}

// newPodGuestNode is a node with a pod network of the test's own, the
// boot volume "boot" and the Secret "seed" holding userData, for podVMI.
func newPodGuestNode(ctx context.Context, t *testing.T, userData string) (*node, *hostPodnet, *podnet.Network, func()) {
	t.Helper()
	n := newNode(t)
	hp := newHostPodnet(t)
	pn, stopPod := hp.start(ctx)
	n.pod = pn
	n.bootVolume(ctx, "boot")
	if _, err := n.kube.CoreV1().Secrets(n.ns).Create(ctx, &k8sv1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "seed", Namespace: n.ns},
		Data:       map[string][]byte{"userdata": []byte(userData)},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return n, hp, pn, stopPod
}

// TestPodNetwork boots a guest on the pod network: the VMI status shows the
// address the guest then gets by DHCP, the guest reaches the gateway, an
// agent restart (handler and pod network) keeps the address and re-applies
// the tap's guard, and the delete releases everything.
func TestPodNetwork(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	n, hp, pn, stopPod := newPodGuestNode(ctx, t, dhcpUserData)
	h, stop := n.handler(true)

	start := time.Now()
	n.schedule(ctx, podVMI("podguest"))
	vmi := n.waitVMI(ctx, "podguest", startTimeout, "Running with an address", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Running && len(v.Status.Interfaces) == 1 && v.Status.Interfaces[0].IP != ""
	})
	t.Logf("create → Running (paused) with an address in %v", time.Since(start).Round(time.Millisecond))
	st := vmi.Status.Interfaces[0]
	ip := net.ParseIP(st.IP)
	if st.Name != "default" || ip == nil || !pn.Subnet().Contains(ip) || ip.Equal(pn.Gateway()) {
		t.Fatalf("status.interfaces[0] %+v: want an address of %s other than the gateway", st, pn.Subnet())
	}
	if !slices.Equal(st.IPs, []string{st.IP}) {
		t.Errorf("status.interfaces[0].ipAddresses %v, want [%s]", st.IPs, st.IP)
	}
	wantMAC, _ := interfaceMAC(vmi, &vmi.Spec.Domain.Devices.Interfaces[0])
	if st.MAC != wantMAC.String() {
		t.Errorf("status.interfaces[0].mac %s, want the derived %s", st.MAC, wantMAC)
	}
	mac, _ := net.ParseMAC(st.MAC)
	if got := pn.Lease(mac); !got.Equal(ip) {
		t.Errorf("lease of %s is %v, status says %s", mac, got, ip)
	}
	tapDev := tapName(vmi.UID, "default")
	tap, err := netlink.LinkByName(tapDev)
	if err != nil {
		t.Fatalf("tap: %v", err)
	}
	if br, err := netlink.LinkByName(hp.cfg.Bridge); err != nil || tap.Attrs().MasterIndex != br.Attrs().Index {
		t.Errorf("tap %s is not on the pod network bridge %s (%v)", tapDev, hp.cfg.Bridge, err)
	}
	// The domain's NIC takes what the attach made: the tap's MTU.
	if x, err := n.lv.DomainXML(ctx, n.ns+"_podguest"); err != nil || len(x.Devices.Interfaces) != 1 {
		t.Errorf("domain interfaces: %v", err)
	} else if m := x.Devices.Interfaces[0].MTU; m == nil || int(m.Size) != tap.Attrs().MTU {
		t.Errorf("domain NIC mtu %+v, want the tap's %d", m, tap.Attrs().MTU)
	}

	cc := n.consoleClient(h)
	conn, err := cc.Console(ctx, n.ns, "podguest")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	log := guest.ReadConsole(conn)
	if err := cc.Do(ctx, n.ns, "podguest", "unpause"); err != nil {
		t.Fatal(err)
	}
	log.ExpectExact(t, "NODEVIRT-NIC eth0 "+st.MAC, bootTimeout)
	leaseLine := fmt.Sprintf("PODNET-LEASE %s/24 gw %s host podguest", ip, pn.Gateway())
	log.ExpectExact(t, leaseLine, 60*time.Second)
	log.ExpectExact(t, "PODNET-PING-42", 30*time.Second)
	log.ExpectExact(t, "NODEVIRT-GUEST-READY", 30*time.Second)
	t.Logf("create → guest leased %s and pinged the gateway in %v", ip, time.Since(start).Round(time.Millisecond))

	// The agent restarts (handler and pod network). Meanwhile the tap's
	// anti-spoofing entry went missing: re-adoption puts it back.
	stop()
	stopPod()
	if !strings.Contains(guardedTaps(t, hp.cfg.Bridge), tapDev) {
		t.Fatalf("tap %s not in the guard map before the restart:\n%s", tapDev, guardedTaps(t, hp.cfg.Bridge))
	}
	del := exec.Command("nft", "delete", "element", "bridge", podnet.TableName(hp.cfg.Bridge), "taps", fmt.Sprintf("{ %q }", tapDev))
	if out, err := del.CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	pn, _ = hp.start(ctx)
	n.pod = pn
	h, _ = n.handler(true)
	vmi = n.waitVMI(ctx, "podguest", 30*time.Second, "Running after the restart", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running && isTrue(v, v1.VirtualMachineInstanceReady)
	})
	if got := vmi.Status.Interfaces; len(got) != 1 || got[0].IP != ip.String() {
		t.Errorf("status.interfaces after the restart %+v, want address %s", got, ip)
	}
	testkit.Poll(t, 30*time.Second, "tap "+tapDev+" re-adopted (guard map)", func() (bool, error) {
		guarded := guardedTaps(t, hp.cfg.Bridge)
		return strings.Contains(guarded, tapDev), errors.New(guarded)
	})
	cc = n.consoleClient(h)
	conn2, err := cc.Console(ctx, n.ns, "podguest")
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close()
	log2 := guest.ReadConsole(conn2)
	log2.Login(t, conn2, 30*time.Second)
	if _, err := conn2.Write([]byte("udhcpc -i eth0 -n -q -t 5 -T 3 -s /run/lease.sh\n")); err != nil {
		t.Fatal(err)
	}
	log2.ExpectExact(t, leaseLine, 60*time.Second)
	log2.ExpectExact(t, "PODNET-PING-42", 30*time.Second)

	// Delete: the tap and the address go with the VMI.
	if err := n.virt.VMIs.Delete(ctx, n.ns, "podguest", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n.waitVMI(ctx, "podguest", 90*time.Second, "gone", func(v *v1.VirtualMachineInstance) bool { return v == nil })
	if _, err := n.lv.Lookup(ctx, n.ns+"_podguest"); !errors.Is(err, launcher.ErrNotFound) {
		t.Errorf("domain after delete: %v", err)
	}
	if _, err := netlink.LinkByName(tapDev); err == nil {
		t.Errorf("tap %s outlived the vmi", tapDev)
	}
	if got := pn.Lease(mac); got != nil {
		t.Errorf("address %s still leased to %s after the delete", got, mac)
	}
	if a := pn.Attachments(); len(a) != 0 {
		t.Errorf("attachments after the delete: %+v", a)
	}
	if strings.Contains(guardedTaps(t, hp.cfg.Bridge), tapDev) {
		t.Errorf("tap %s still in the guard map after the delete", tapDev)
	}
}

// TestPodNetworkUnavailable: a node whose pod network could not be set up
// keeps pod network VMIs waiting with the reason, and starts them once it
// can.
func TestPodNetworkUnavailable(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	n := newNode(t)
	pn, err := podnet.New(podnet.Config{Bridge: "nvpnunused", StateDir: t.TempDir(), ResolvConf: "/nonexistent",
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	n.pod, n.podErr = pn, errors.New("podnet cidr 10.244.0.0/24 overlaps address 10.244.0.1/24 on link 7: choose another subnet")
	n.handler(true)
	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Name: "waits"},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("64Mi")}},
				Devices: v1.Devices{Interfaces: []v1.Interface{{Name: "default",
					InterfaceBindingMethod: v1.InterfaceBindingMethod{Masquerade: &v1.InterfaceMasquerade{}}}}},
			},
			Networks: []v1.Network{*v1.DefaultPodNetwork()},
		},
	}
	n.schedule(ctx, vmi)
	got := n.waitVMI(ctx, "waits", 30*time.Second, "waiting for the pod network", func(v *v1.VirtualMachineInstance) bool {
		s := condition(v, v1.VirtualMachineInstanceSynchronized)
		return s != nil && s.Status == k8sv1.ConditionFalse
	})
	s := condition(got, v1.VirtualMachineInstanceSynchronized)
	if got.Status.Phase != v1.Scheduled || s.Reason != "Waiting" || !strings.Contains(s.Message, "the pod network of node "+n.name+" is not available") ||
		!strings.Contains(s.Message, "overlaps address") {
		t.Errorf("phase %s, Synchronized %s %q", got.Status.Phase, s.Reason, s.Message)
	}
	if _, err := n.lv.Lookup(ctx, n.ns+"_waits"); !errors.Is(err, launcher.ErrNotFound) {
		t.Errorf("a domain exists: %v", err)
	}
	if _, err := netlink.LinkByName(tapName(got.UID, "default")); err == nil {
		t.Errorf("a tap was made for a vmi that waits")
	}
}

func TestPodMAC(t *testing.T) {
	vmi := &v1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{UID: "5f0c"}}
	a, err := interfaceMAC(vmi, &v1.Interface{Name: "default"})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := interfaceMAC(vmi, &v1.Interface{Name: "default"})
	c, _ := interfaceMAC(vmi, &v1.Interface{Name: "other"})
	if a.String() != b.String() || a.String() == c.String() {
		t.Errorf("derived MACs %s %s %s: want stable per interface and distinct", a, b, c)
	}
	if a[0]&0x02 == 0 || a[0]&0x01 != 0 {
		t.Errorf("derived MAC %s is not locally administered unicast", a)
	}
	if m, _ := interfaceMAC(vmi, &v1.Interface{Name: "default", MacAddress: "02:00:00:00:00:07"}); m.String() != "02:00:00:00:00:07" {
		t.Errorf("spec MAC not kept: %s", m)
	}
	if _, err := interfaceMAC(vmi, &v1.Interface{Name: "default", MacAddress: "zz"}); !errors.Is(err, errSpec) {
		t.Errorf("bad spec MAC: %v", err)
	}
}
