package vmsnapshot

import (
	"context"
	"net/http"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// NodeCaller reaches the node agent running a VMI; the brain's
// subresources.NodeClient is one. A call to a node that does not answer
// fails.
type NodeCaller interface {
	Call(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, method, action string, body []byte) ([]byte, error)
}

// NodeFreezer freezes and thaws guests through their node agents'
// freeze and unfreeze actions (package console's protocol).
type NodeFreezer struct{ Node NodeCaller }

var _ Freezer = NodeFreezer{}

// Freeze implements Freezer.
func (f NodeFreezer) Freeze(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	_, err := f.Node.Call(ctx, vmi, http.MethodPut, "freeze", nil)
	return err
}

// Unfreeze implements Freezer.
func (f NodeFreezer) Unfreeze(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	_, err := f.Node.Call(ctx, vmi, http.MethodPut, "unfreeze", nil)
	return err
}
