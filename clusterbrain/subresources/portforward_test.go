package subresources

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// TestPortForward opens port-forward tunnels through the aggregated API to
// the stand-in node: several at once (virtctl opens one per connection),
// on a VMI and on its VM; bad ports, protocols and paused or absent VMIs
// are refused as virt-api refuses them.
func TestPortForward(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)
	newVMI(t, ns, "pf", kubevirtv1.Running)
	newVMI(t, ns, "pfpaused", kubevirtv1.Running, kubevirtv1.VirtualMachineInstancePaused)

	a, err := c.Stream(ctx, "pf", "portforward/22", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := c.Stream(ctx, "pf", "portforward/5353/udp", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	readUntil(t, a, "guest port 22/tcp", 10*time.Second)
	readUntil(t, b, "guest port 5353/udp", 10*time.Second)
	// Both tunnels stay open side by side.
	for _, s := range []io.ReadWriter{a, b} {
		if _, err := s.Write([]byte("ping-through-tunnel")); err != nil {
			t.Fatal(err)
		}
		readUntil(t, s, "ping-through-tunnel", 10*time.Second)
	}
	if calls := strings.Join(env.node.called(), ","); !strings.Contains(calls, "GET "+ns+"/pf/portforward/22/tcp") ||
		!strings.Contains(calls, "GET "+ns+"/pf/portforward/5353/udp") {
		t.Errorf("node calls %s", calls)
	}

	// The VM variant reaches the VMI the VM owns.
	vm := newVM(t, ns, "pfvm", kubevirtv1.RunStrategyHalted)
	_, err = vmStream(ctx, c, "pfvm", "portforward/80")
	wantStreamError(t, "vm not started", err, http.StatusConflict, "VMI is not started")
	vm.Status.Created = true
	if _, err := env.virt.VMs.UpdateStatus(ctx, vm); err != nil {
		t.Fatal(err)
	}
	vmi := newVMI(t, ns, "pfvm", kubevirtv1.Running)
	_, err = vmStream(ctx, c, "pfvm", "portforward/80")
	wantStreamError(t, "vmi not owned by the vm", err, http.StatusNotFound, "pfvm")
	vmi.OwnerReferences = []metav1.OwnerReference{{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachine", Name: vm.Name, UID: vm.UID}}
	if _, err := env.virt.VMIs.Update(ctx, vmi); err != nil {
		t.Fatal(err)
	}
	v, err := vmStream(ctx, c, "pfvm", "portforward/80/tcp")
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	readUntil(t, v, "guest port 80/tcp", 10*time.Second)

	for _, tc := range []struct {
		name, sub string
		code      int
		msg       string
	}{
		{"pf", "portforward/0", http.StatusBadRequest, "not a port number"},
		{"pf", "portforward/65536", http.StatusBadRequest, "not a port number"},
		{"pf", "portforward/ssh", http.StatusBadRequest, "not a port number"},
		{"pf", "portforward/22/sctp", http.StatusBadRequest, "tcp or udp"},
		{"pf", "portforward/22/tcp/extra", http.StatusNotFound, ""},
		{"pfpaused", "portforward/22", http.StatusConflict, "VMI is paused"},
		{"absent", "portforward/22", http.StatusNotFound, "absent"},
	} {
		_, err := c.Stream(ctx, tc.name, tc.sub, nil)
		wantStreamError(t, tc.name+" "+tc.sub, err, tc.code, tc.msg)
	}
}

// vmStream opens a stream of a VM subresource.
func vmStream(ctx context.Context, c *virtctl.Client, name, sub string) (io.ReadWriteCloser, error) {
	vc := *c
	return vc.StreamOf(ctx, "virtualmachines", name, sub, nil)
}

func wantStreamError(t *testing.T, what string, err error, code int, msg string) {
	t.Helper()
	var se *virtctl.StreamError
	if !errors.As(err, &se) || se.Code != code || !strings.Contains(se.Error(), msg) {
		t.Errorf("%s: got %v, want %d containing %q", what, err, code, msg)
	}
}

// TestScreenshot fetches vnc/screenshot as upstream virtctl does (GET with
// moveCursor): the node's PNG comes back as it is; a VMI without a display
// is refused.
func TestScreenshot(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	newVMI(t, ns, "shot", kubevirtv1.Running)
	rc := controlplane.Shared(t).Clientset(t).Discovery().RESTClient()
	path := "/apis/" + Group + "/v1/namespaces/" + ns + "/virtualmachineinstances/shot/vnc/screenshot"
	body, err := rc.Get().AbsPath(path).Param("moveCursor", "false").DoRaw(ctx)
	if err != nil || !strings.HasPrefix(string(body), "\x89PNG\r\n\x1a\n") || !strings.HasSuffix(string(body), "shot") {
		t.Fatalf("screenshot: %q %v", body, err)
	}
	headless := newVMI(t, ns, "headless", kubevirtv1.Running)
	no := false
	headless.Spec.Domain.Devices.AutoattachGraphicsDevice = &no
	if _, err := env.virt.VMIs.Update(ctx, headless); err != nil {
		t.Fatal(err)
	}
	_, err = rc.Get().AbsPath("/apis/" + Group + "/v1/namespaces/" + ns + "/virtualmachineinstances/headless/vnc/screenshot").DoRaw(ctx)
	if !apierrors.IsBadRequest(err) {
		t.Errorf("screenshot of a vmi without a display: %v", err)
	}
	_, err = rc.Get().AbsPath("/apis/" + Group + "/v1/namespaces/" + ns + "/virtualmachineinstances/absent/vnc/screenshot").DoRaw(ctx)
	if !apierrors.IsNotFound(err) {
		t.Errorf("screenshot of an absent vmi: %v", err)
	}
}
