package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/test/guest"
)

// TestCrossNodeGuest: a guest on the second node is reached through the
// brain as one on the first is: upstream virtctl's vnc, guestosinfo (the
// guest agent) and soft-reboot; and guests on both nodes reach out of their
// node over the pod network (masquerade binding, an address from the
// node's DHCP server), the second node's seen from outside with its node's
// address.
func TestCrossNodeGuest(t *testing.T) {
	t.Parallel()
	e := require(t)
	node2 := e.secondNode(t)
	n := e.namespace(t)
	egress := serveEgress(t, e.fabric().Gateway())

	remote := n.newVM("remote", kubevirtv1.RunStrategyAlways, withNodeSelector(node2.Name), onSecondNodeToo(), withPodNetwork(),
		withUserData(egressUserData(egress.addr, "/remote")), withGuestAgent(n.agentDisk("remote")))
	local := n.newVM("local", kubevirtv1.RunStrategyAlways, withNodeSelector(e.nodeName), withPodNetwork(),
		withUserData(egressUserData(egress.addr, "/local")))
	n.createVM(remote)
	n.createVM(local)
	for vm, node := range map[string]string{"remote": node2.Name, "local": e.nodeName} {
		if vmi := n.waitVMIOfVM(vm, 3*time.Minute); vmi.Status.NodeName != node {
			t.Fatalf("vmi %s runs on %s, want %s", vm, vmi.Status.NodeName, node)
		}
	}
	serial := n.serialOn(node2, "remote")
	serial.expect(`NODEVIRT-GUEST-READY`, bootTimeout)

	// Egress from each node: the guest's request reaches a server outside
	// its node.
	for vm, logs := range map[string]*serialLog{"remote": serial, "local": n.serial("local")} {
		logs.expect(`E2E-EGRESS-(OK|FAILED)`, 3*time.Minute)
		if !logs.contains(`E2E-EGRESS-OK`) {
			t.Errorf("%s could not reach %s over the pod network", vm, egress.addr)
		}
	}
	if from := egress.from("/remote"); from != node2.IP {
		t.Errorf("the request of the guest on %s came from %q, want its node's address %s (masquerade)", node2.Name, from, node2.IP)
	}

	u := n.upstreamVirtctl()
	u.checkVNC("remote")

	n.waitVMI("remote", 2*time.Minute, "AgentConnected", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		return hasCondition(vmi, kubevirtv1.VirtualMachineInstanceAgentConnected)
	})
	var info kubevirtv1.VirtualMachineInstanceGuestAgentInfo
	out := u.run(time.Minute, "guestosinfo", "remote")
	doc := out[max(strings.Index(out, "{"), 0) : strings.LastIndex(out, "}")+1] // the JSON, without what virtctl logs
	if err := json.Unmarshal([]byte(doc), &info); err != nil || info.GAVersion == "" || info.OS.KernelRelease == "" {
		t.Errorf("virtctl guestosinfo of the guest on %s: %v %q, want the agent's version and the kernel", node2.Name, err, out)
	}

	first, err := n.getVMI("remote")
	if err != nil {
		t.Fatal(err)
	}
	out = u.run(time.Minute, "soft-reboot", "remote")
	if !strings.Contains(out, "was scheduled to soft-reboot") {
		t.Errorf("virtctl soft-reboot said %q", out)
	}
	// The guest powers off and boots again in the same QEMU: its init's
	// first marker shows it. (A second boot on loaded cores was seen
	// taking more than bootTimeout to get to READY.)
	serial.expect(`NODEVIRT-GUEST-POWEROFF`, 60*time.Second)
	serial.expect(`NODEVIRT-GUEST-BOOTED`, 2*bootTimeout)
	if vmi, err := n.getVMI("remote"); err != nil || vmi.UID != first.UID || vmi.Status.Phase != kubevirtv1.Running || vmi.Status.NodeName != node2.Name {
		t.Errorf("after soft-reboot the VMI is %v (err %v), want the same running VMI %s on %s", vmiSummary(vmi), err, first.UID, node2.Name)
	}
}

// withPodNetwork adds a NIC with the masquerade binding on the pod network.
func withPodNetwork() vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.Domain.Devices.Interfaces = append(s.Domain.Devices.Interfaces, kubevirtv1.Interface{Name: "default",
			InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Masquerade: &kubevirtv1.InterfaceMasquerade{}}})
		s.Networks = append(s.Networks, *kubevirtv1.DefaultPodNetwork())
	}
}

// withGuestAgent boots the VMI from disk, a boot disk whose guest runs
// the QEMU guest agent.
func withGuestAgent(disk string) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.Volumes[0].HostDisk.Path = disk }
}

// agentDisk makes the private boot disk of VM vm, whose guest runs the QEMU
// guest agent.
func (n *testNS) agentDisk(vm string) string {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, err := guest.BootDisk(ctx, guest.DiskSpec{Initramfs: guest.Spec{GuestAgent: true}})
	if err != nil {
		n.t.Fatalf("guest image with an agent: %v", err)
	}
	dst := n.e.path("disks", n.name, vm+"-agent.raw")
	if err := copyDisk(src, dst); err != nil {
		n.t.Fatal(err)
	}
	return dst
}

// egressUserData takes an address from the pod network's DHCP server
// (busybox udhcpc) and asks the egress server for path until it answers
// (busybox nc: the static busybox's wget crashes), in the background. The
// markers it prints are not in its own text, which the guest echoes.
func egressUserData(server, path string) string {
	host, port, _ := net.SplitHostPort(server)
	return fmt.Sprintf(`#!/bin/sh
cat > /run/dhcp.sh <<'EOF'
#!/bin/sh
case "$1" in
bound|renew)
  ip addr flush dev "$interface"
  ip addr add "$ip/$mask" dev "$interface"
  [ -n "$router" ] && ip route replace default via "${router%%%% *}"
  echo "E2E-DHCP $interface $ip/$mask"
  ;;
esac
EOF
chmod +x /run/dhcp.sh
(
  ip link set eth0 up
  udhcpc -i eth0 -s /run/dhcp.sh -t 30 -T 2 -n -q 2>/dev/null || echo E2E-DHCP-FAILED
  r=FAILED i=0
  while [ $i -lt 60 ]; do
    if printf 'GET %s HTTP/1.0\r\n\r\n' | nc -w 5 %s %s 2>/dev/null | grep -q '^ok'; then r=OK; break; fi
    i=$((i + 1)); sleep 2
  done
  echo "E2E-EGRESS-$r"
) &
`, path, host, port)
}

// egressServer answers every request and records the peer address of the
// last request to each path.
type egressServer struct {
	addr string
	mu   sync.Mutex
	seen map[string]string
}

func serveEgress(t *testing.T, host string) *egressServer {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatalf("egress server on %s: %v", host, err)
	}
	s := &egressServer{addr: l.Addr().String(), seen: map[string]string{}}
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 30 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			host, _, _ := net.SplitHostPort(r.RemoteAddr)
			s.mu.Lock()
			s.seen[r.URL.Path] = host
			s.mu.Unlock()
			fmt.Fprintln(w, "ok")
		})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return s
}

func (s *egressServer) from(path string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen[path]
}
