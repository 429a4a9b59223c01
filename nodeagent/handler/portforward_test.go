package handler

import (
	"bytes"
	"context"
	"image/png"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"github.com/nodevirt/nodevirt/test/guest"
)

// listenerUserData takes a pod network address by DHCP, then serves a
// page with busybox httpd on port 8080 and prints when it listens.
const listenerUserData = dhcpUserData + `mkdir -p /www
echo "page-from-the-guest-$((6*7))" >/www/index.html
httpd -p 8080 -h /www && echo PORTFORWARD-LISTENING
`

// TestPortForward forwards to a real guest's TCP listener through the
// node's console server: the node dials the address its pod network leased
// to the guest, two tunnels work side by side, a port nothing listens on
// fails naming the address, a masquerade interface that lists its ports
// forwards only those, and a VMI without a pod network interface is
// refused. The guest's display answers a screenshot.
func TestPortForward(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	n, _, _, _ := newPodGuestNode(ctx, t, listenerUserData)
	h, _ := n.handler(true)
	vmi := podVMI("pfguest")
	vmi.Spec.Domain.Devices.Interfaces[0].Ports = []v1.Port{{Port: 8080}, {Port: 9, Protocol: "UDP"}, {Port: 8081}}
	n.schedule(ctx, vmi)
	vmi = n.waitVMI(ctx, "pfguest", startTimeout, "Running with an address", func(v *v1.VirtualMachineInstance) bool {
		return v != nil && v.Status.Phase == v1.Running && len(v.Status.Interfaces) == 1 && v.Status.Interfaces[0].IP != ""
	})
	ip := vmi.Status.Interfaces[0].IP
	cc := n.consoleClient(h)
	conn, err := cc.Console(ctx, n.ns, "pfguest")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	log := guest.ReadConsole(conn)
	if err := cc.Do(ctx, n.ns, "pfguest", "unpause"); err != nil {
		t.Fatal(err)
	}
	log.ExpectExact(t, "PODNET-PING-42", bootTimeout+60*time.Second)
	log.ExpectExact(t, "PORTFORWARD-LISTENING", 30*time.Second)

	get := func() string {
		t.Helper()
		c, err := cc.PortForward(ctx, n.ns, "pfguest", 8080, "tcp")
		if err != nil {
			t.Fatalf("port forward 8080: %v", err)
		}
		defer c.Close()
		if _, err := io.WriteString(c, "GET /index.html HTTP/1.0\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(60 * time.Second))
		b, _ := io.ReadAll(c)
		return string(b)
	}
	// Two tunnels at once: the first stays open while the second answers.
	first, err := cc.PortForward(ctx, n.ns, "pfguest", 8080, "tcp")
	if err != nil {
		t.Fatal(err)
	}
	if page := get(); !strings.Contains(page, "200 OK") || !strings.Contains(page, "page-from-the-guest-42") {
		t.Fatalf("page through the tunnel:\n%s", page)
	}
	if _, err := io.WriteString(first, "GET / HTTP/1.0\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	first.SetReadDeadline(time.Now().Add(60 * time.Second))
	if b, _ := io.ReadAll(first); !strings.Contains(string(b), "page-from-the-guest-42") {
		t.Errorf("first tunnel after the second:\n%s", b)
	}
	first.Close()

	// Nothing listens on 8081: the node's dial fails and says where.
	_, err = cc.PortForward(ctx, n.ns, "pfguest", 8081, "tcp")
	if err == nil || !strings.Contains(err.Error(), "502") || !strings.Contains(err.Error(), net.JoinHostPort(ip, "8081")) {
		t.Errorf("port forward to a closed port: %v", err)
	}
	// The interface lists its ports: 22 is not among them, 9 only as UDP.
	for _, p := range []struct {
		port  int
		proto string
	}{{22, "tcp"}, {9, "tcp"}} {
		_, err = cc.PortForward(ctx, n.ns, "pfguest", p.port, p.proto)
		if err == nil || !strings.Contains(err.Error(), "403") || !strings.Contains(err.Error(), "not among the ports") {
			t.Errorf("port forward %d/%s not listed: %v", p.port, p.proto, err)
		}
	}
	if _, err := cc.PortForward(ctx, n.ns, "pfguest", 9, "udp"); err != nil {
		t.Errorf("udp 9 is listed: %v", err)
	}
	// Hostile ports and protocols never reach a dial.
	for _, bad := range []struct {
		port  int
		proto string
	}{{0, "tcp"}, {70000, "tcp"}, {8080, "sctp"}, {-1, "udp"}} {
		if _, err := cc.PortForward(ctx, n.ns, "pfguest", bad.port, bad.proto); err == nil || !strings.Contains(err.Error(), "400") {
			t.Errorf("port forward %d/%s: %v", bad.port, bad.proto, err)
		}
	}
	if _, err := cc.PortForward(ctx, n.ns, "absent", 8080, "tcp"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("port forward to an absent vmi: %v", err)
	}

	// The same guest's display, photographed: a PNG of the VGA text
	// console's size.
	shot, err := cc.Screenshot(ctx, n.ns, "pfguest")
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	if img, err := png.Decode(bytes.NewReader(shot)); err != nil || img.Bounds().Dx() < 320 || img.Bounds().Dy() < 200 {
		t.Errorf("screenshot: %d bytes, not a display-sized PNG (%v)", len(shot), err)
	}

	// A VMI whose only interface is on a Multus network has no address
	// the node may dial.
	multus := vmi.DeepCopy()
	multus.Spec.Networks = []v1.Network{{Name: "default", NetworkSource: v1.NetworkSource{Multus: &v1.MultusNetwork{NetworkName: "br"}}}}
	multus.Spec.Domain.Devices.Interfaces[0].Masquerade = nil
	multus.Spec.Domain.Devices.Interfaces[0].Bridge = &v1.InterfaceBridge{}
	if _, _, err := h.podAddress(multus); httperr.Code(err) != 400 || !strings.Contains(err.Error(), "no interface on the pod network") {
		t.Errorf("multus-only vmi: %v", err)
	}
}
