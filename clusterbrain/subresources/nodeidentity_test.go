package subresources

import (
	"context"
	"net/http"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// A node whose certificate is its own (signed by the node CA, carrying
// the names every node shares) cannot receive the console of a VMI on
// another node by having that node's endpoint point at itself: the brain
// dials the VMI's node and accepts only a certificate naming it.
func TestConsoleGoesOnlyToTheVMIsOwnNode(t *testing.T) {
	setup(t)
	ctx := context.Background()
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	kube := cp.Clientset(t)
	ca, err := uploadtls.EnsureCA(ctx, kube, "nodevirt-subresources-test")
	if err != nil {
		t.Fatal(err)
	}
	impostor := startStandin(t, ca, "impostor-"+ns)
	victim := "victim-" + ns
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: victim, Annotations: map[string]string{identity.NodeAddressAnnotation: impostor.addr}}}
	if _, err := kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kube.CoreV1().Nodes().Delete(context.Background(), victim, metav1.DeleteOptions{}) })
	vmi := newVMI(t, ns, "elsewhere", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceAgentConnected)
	vmi.Status.NodeName = victim
	if _, err := env.virt.VMIs.UpdateStatus(ctx, vmi); err != nil {
		t.Fatal(err)
	}

	c := adminIn(t, ns)
	stream, err := c.Stream(ctx, "elsewhere", "console", nil)
	if err == nil {
		stream.Close()
		t.Fatal("the console of a VMI on another node was streamed to the impostor")
	}
	wantStatus(t, "console via an impostor", err, http.StatusInternalServerError, "certificate is valid for")
	if err := c.GuestInfo(ctx, "elsewhere", "guestosinfo", &kubevirtv1.VirtualMachineInstanceGuestAgentInfo{}); err == nil {
		t.Fatal("a guest-agent call reached the impostor")
	}
	impostor.mu.Lock()
	defer impostor.mu.Unlock()
	if impostor.consoles != 0 || len(impostor.calls) != 0 {
		t.Fatalf("the impostor served %d consoles and calls %v", impostor.consoles, impostor.calls)
	}
}
