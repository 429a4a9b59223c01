// Package live holds a setting a daemon follows from a CR in force (the
// KubeVirt CR's CPU models, memory overcommit, hotplug gates, through
// crwatch): the watch's consumer replaces it, any goroutine reads it.
//
// A nil or never-set Value reads as its type's zero value, so a setting's
// zero value is what the setting is without a CR: a role built without the
// holder (a test, a standalone run) behaves as in a cluster with no CR.
package live

import "sync/atomic"

// Value is a setting in force, safe for concurrent use.
type Value[T any] struct{ cur atomic.Pointer[T] }

// Set replaces the setting.
func (v *Value[T]) Set(x T) { v.cur.Store(&x) }

// Get returns the setting in force (the zero T before any Set, or on a nil
// Value).
func (v *Value[T]) Get() T {
	if v != nil {
		if x := v.cur.Load(); x != nil {
			return *x
		}
	}
	var zero T
	return zero
}
