package handler

import (
	"context"
	"errors"
	"fmt"

	"k8s.io/apimachinery/pkg/types"
)

// StopGuests destroys every running domain this handler made, at once and
// without the API server (self-fencing, package fencing: the node is cut
// off and its VMIs are about to be started elsewhere). The domains stay
// defined; when the node is back, the reconcile finds their VMIs failed
// over or gone and cleans up. It returns how many it stopped.
func (h *Handler) StopGuests(ctx context.Context) (int, error) {
	lv, err := h.manager()
	if err != nil {
		return 0, err
	}
	doms, err := lv.List(ctx)
	if err != nil {
		return 0, fmt.Errorf("list domains: %w", err)
	}
	stopped := 0
	var errs []error
	for _, d := range doms {
		if !d.HasVMI || !h.owns(types.UID(d.VMI.UID)) || !d.State.Active() {
			continue
		}
		if err := lv.Destroy(ctx, d.Name); err != nil {
			errs = append(errs, err)
			continue
		}
		stopped++
		h.log.Warn("guest stopped by self-fencing", "vmi", d.VMI.Namespace+"/"+d.VMI.Name, "domain", d.Name)
	}
	return stopped, errors.Join(errs...)
}
