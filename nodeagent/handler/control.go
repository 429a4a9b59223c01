package handler

import (
	"context"
	"fmt"
	"io"
	"net"
	"time"

	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/nodeagent/console"
)

// running finds the VMI namespace/name among this node's and its active
// domain.
func (h *Handler) running(ctx context.Context, namespace, name string) (*v1.VirtualMachineInstance, *launcher.Manager, string, error) {
	obj, ok, err := h.vmis.GetIndexer().GetByKey(namespace + "/" + name)
	if err != nil {
		return nil, nil, "", err
	}
	if !ok {
		return nil, nil, "", fmt.Errorf("%w: %s/%s", console.ErrNotFound, namespace, name)
	}
	vmi := obj.(*v1.VirtualMachineInstance)
	lv, err := h.manager()
	if err != nil {
		return nil, nil, "", err
	}
	dom := domain.Name(namespace, name)
	info, found, err := lookup(ctx, lv, dom)
	if err != nil {
		return nil, nil, "", err
	}
	if !found || !info.State.Active() || types.UID(info.VMI.UID) != vmi.UID {
		return nil, nil, "", fmt.Errorf("%w: %s/%s has no running domain", console.ErrNotRunning, namespace, name)
	}
	return vmi, lv, dom, nil
}

// Console opens the VMI's serial console, taking it over from an earlier
// session.
func (h *Handler) Console(ctx context.Context, namespace, name string) (io.ReadWriteCloser, error) {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	return lv.Console(ctx, dom)
}

// VNC connects to the VMI's VNC server.
func (h *Handler) VNC(ctx context.Context, namespace, name string) (io.ReadWriteCloser, error) {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	sock, err := lv.VNCSocket(ctx, dom)
	if err != nil {
		return nil, err
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, fmt.Errorf("vnc of %s/%s: %w", namespace, name, err)
	}
	return c, nil
}

// Pause pauses the VMI's vCPUs; the Paused condition follows the domain
// event.
func (h *Handler) Pause(ctx context.Context, namespace, name string) error {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return err
	}
	return lv.Pause(ctx, dom)
}

// Unpause resumes a paused VMI.
func (h *Handler) Unpause(ctx context.Context, namespace, name string) error {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return err
	}
	return lv.Unpause(ctx, dom)
}

// SoftReboot asks the guest to reboot through ACPI.
func (h *Handler) SoftReboot(ctx context.Context, namespace, name string) error {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return err
	}
	return lv.Reboot(ctx, dom)
}

// Reset resets the VMI like a reset button.
func (h *Handler) Reset(ctx context.Context, namespace, name string) error {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return err
	}
	return lv.Reset(ctx, dom)
}

// Shutdown starts a graceful shutdown within the VMI's termination grace
// period; the VMI then succeeds.
func (h *Handler) Shutdown(ctx context.Context, namespace, name string) error {
	vmi, lv, _, err := h.running(ctx, namespace, name)
	if err != nil {
		return err
	}
	grace := DefaultGracePeriod
	if s := vmi.Spec.TerminationGracePeriodSeconds; s != nil {
		grace = time.Duration(*s) * time.Second
	}
	h.beginShutdown(lv, vmi, grace)
	return nil
}

var _ console.ScreenshotBackend = (*Handler)(nil)

// Screenshot takes a PNG picture of the VMI's display.
func (h *Handler) Screenshot(ctx context.Context, namespace, name string) ([]byte, error) {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	return lv.Screenshot(ctx, dom)
}
