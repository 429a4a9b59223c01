package scheduler

import (
	"time"

	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Placement before creation: the VM controller asks for a node before it
// creates a VMI, creates the VMI with the kubevirt.io/nodeName label of
// that node, and the scheduler binds it with one status write (nodeName,
// phase Scheduled) when it appears, instead of a status write and a label
// patch. The node is held for the VMI from the decision on, so decisions in
// between never double-book it. A reservation whose VMI does not appear in
// time is forgotten; the VMI, if it still comes, is then placed like any
// other (and its label corrected if the node differs).

// reservationTTL bounds how long a reservation holds a node for a VMI
// that has not appeared.
const reservationTTL = 30 * time.Second

// reservation is a node held for a VMI about to be created.
type reservation struct {
	assumption
	at time.Time
}

// Reserve decides where vmi, about to be created (it has no UID yet),
// goes and holds that node for it until it is bound. It returns "" when
// the VMI cannot be placed now, uses claims, or the scheduler's caches are
// not ready: the VMI is then created without a node and scheduled when it
// appears, as any other.
func (s *Scheduler) Reserve(vmi *kubevirtv1.VirtualMachineInstance) string {
	if !s.ready.Load() || hasClaims(vmi) {
		return ""
	}
	key := vmi.Namespace + "/" + vmi.Name
	s.decideMu.Lock()
	defer s.decideMu.Unlock()
	s.mu.Lock()
	delete(s.reserved, key)
	s.mu.Unlock()
	// A UID of its own until the real one is known, so that affinity
	// rules tell it from other reserved VMIs.
	v := *vmi
	v.UID = types.UID("reserved:" + key)
	node, _, p, err := s.decide(&v, nil) // no claims: no snapshot to locate
	if err != nil {
		return ""
	}
	s.mu.Lock()
	s.reserved[key] = reservation{assumption: assumption{node: node, p: p}, at: s.now()}
	s.mu.Unlock()
	return node
}

// Unreserve releases what Reserve held for the VMI namespace/name (its
// creation failed).
func (s *Scheduler) Unreserve(namespace, name string) {
	s.mu.Lock()
	delete(s.reserved, namespace+"/"+name)
	s.mu.Unlock()
	s.retryWaiting()
}

// claimReservation turns the reservation made for vmi's name into an
// assumption for vmi and returns its node, when vmi carries that node's
// label and the reservation is still valid; otherwise it drops the
// reservation and returns "". Callers hold decideMu.
func (s *Scheduler) claimReservation(key string, vmi *kubevirtv1.VirtualMachineInstance) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.reserved[key]
	if !ok {
		return ""
	}
	delete(s.reserved, key)
	if s.now().Sub(r.at) > reservationTTL || vmi.Labels[kubevirtv1.NodeNameLabel] != r.node {
		return ""
	}
	a := r.assumption
	a.p.uid = vmi.UID
	s.assumed[vmi.UID] = a
	delete(s.waiting, key)
	return a.node
}

// liveReservations copies the reservations still valid, dropping the
// expired ones. Callers hold s.mu.
func (s *Scheduler) liveReservations() []assumption {
	out := make([]assumption, 0, len(s.reserved))
	now := s.now()
	for k, r := range s.reserved {
		if now.Sub(r.at) > reservationTTL {
			delete(s.reserved, k)
			continue
		}
		out = append(out, r.assumption)
	}
	return out
}

// hasClaims reports whether vmi uses persistent volume claims, whose
// binding the scheduler decides with the VMI (claims waiting for their
// first consumer get the node): such VMIs are placed once they exist.
func hasClaims(vmi *kubevirtv1.VirtualMachineInstance) bool {
	for _, v := range vmi.Spec.Volumes {
		if v.PersistentVolumeClaim != nil || v.DataVolume != nil {
			return true
		}
	}
	return false
}
