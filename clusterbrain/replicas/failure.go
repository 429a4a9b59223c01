package replicas

import (
	"fmt"
	"slices"
)

// scaleFailure is why a sync could not bring the members to the count:
// the ReplicaFailure condition's reason and the error behind it.
type scaleFailure struct {
	reason string
	err    error
}

// wrap is the sync's error for f (nil when nothing failed), naming what.
func (f *scaleFailure) wrap(what string) error {
	if f == nil {
		return nil
	}
	return fmt.Errorf("%s: %s: %w", what, f.reason, f.err)
}

// withFailure returns conds with the ReplicaFailure condition (isFailure
// finds it, build makes it from a reason and a message) as KubeVirt's
// controllers keep it: added when failed is set and the condition is
// absent (an existing one keeps its reason, message and time), removed
// when failed is nil; added tells whether it was added. conds itself is
// never changed (it belongs to the informer's cache).
func withFailure[C any](conds []C, failed *scaleFailure, isFailure func(C) bool, build func(reason, message string) C) (out []C, added bool) {
	i := slices.IndexFunc(conds, isFailure)
	switch {
	case failed != nil && i < 0:
		return append(slices.Clone(conds), build(failed.reason, failed.err.Error())), true
	case failed == nil && i >= 0:
		return slices.Delete(slices.Clone(conds), i, i+1), false
	}
	return conds, false
}
