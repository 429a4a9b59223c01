package handler

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	"github.com/vishvananda/netlink"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"
)

// TestBridgeTapFeedsDomain: what bridge.AttachTap made is what the domain
// gets. A network whose config sets an MTU below the bridge's gives the tap
// that MTU and the guest's NIC the same (<mtu size=>); a NIC without a MAC
// gets the one its port was made for, which is also what the VMI reports.
func TestBridgeTapFeedsDomain(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n := newNode(t)
	n.bootVolume(ctx, "base")
	conf, _ := json.Marshal(map[string]any{"cniVersion": "0.3.1", "name": "jumbo-not", "type": "cnv-bridge", "bridge": n.bridge, "mtu": 1400})
	if _, err := n.virt.NADs.Create(ctx, &nadv1.NetworkAttachmentDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "small-mtu", Namespace: n.ns},
		Spec:       nadv1.NetworkAttachmentDefinitionSpec{Config: string(conf)},
	}); err != nil {
		t.Fatal(err)
	}
	n.handler(true)

	vmi := ephemeralVMI("mtu")
	paused := v1.StartStrategyPaused
	vmi.Spec.StartStrategy = &paused
	vmi.Spec.Domain.Devices.Interfaces = []v1.Interface{{Name: "lan",
		InterfaceBindingMethod: v1.InterfaceBindingMethod{Bridge: &v1.InterfaceBridge{}}}}
	vmi.Spec.Networks = []v1.Network{{Name: "lan", NetworkSource: v1.NetworkSource{Multus: &v1.MultusNetwork{NetworkName: "small-mtu"}}}}
	n.schedule(ctx, vmi)
	running := n.waitVMI(ctx, "mtu", startTimeout, "Running", func(v *v1.VirtualMachineInstance) bool {
		return v.Status.Phase == v1.Running
	})

	tap, err := netlink.LinkByName(tapName(running.UID, "lan"))
	if err != nil {
		t.Fatalf("tap: %v", err)
	}
	if tap.Attrs().MTU != 1400 {
		t.Errorf("tap MTU %d, want the network's 1400", tap.Attrs().MTU)
	}
	x, err := n.lv.DomainXML(ctx, n.ns+"_mtu")
	if err != nil {
		t.Fatal(err)
	}
	if len(x.Devices.Interfaces) != 1 {
		t.Fatalf("domain interfaces %+v", x.Devices.Interfaces)
	}
	nic := x.Devices.Interfaces[0]
	if nic.MTU == nil || nic.MTU.Size != 1400 {
		t.Errorf("domain NIC mtu %+v, want 1400 (the tap's)", nic.MTU)
	}
	mac, err := interfaceMAC(running, &running.Spec.Domain.Devices.Interfaces[0])
	if err != nil {
		t.Fatal(err)
	}
	if nic.MAC == nil || nic.MAC.Address != mac.String() {
		t.Errorf("domain NIC mac %+v, want %s (the one its port was made for)", nic.MAC, mac)
	}
	if len(running.Status.Interfaces) != 1 || running.Status.Interfaces[0].MAC != mac.String() {
		t.Errorf("status.interfaces %+v, want mac %s", running.Status.Interfaces, mac)
	}
}
