package scheduler

import (
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/migstate"
)

// Live migrations: from the moment a migration's target node is chosen
// until the migration ends, the target holds the VMI's requests as well as
// the source does (KubeVirt's target pod does the same), so no decision in
// between gives that capacity to another VMI. Two things hold it:
//
//   - DecideMigration holds the target it chooses at once, in memory, as
//     the scheduler's other decisions are (under decideMu);
//   - from the moment the VirtualMachineInstanceMigration's
//     status.migrationState.targetNode is seen, the migration holds it,
//     until the migration is Succeeded or Failed (cancelled migrations end
//     Failed). A succeeded one has moved the VMI (status.nodeName is the
//     target): the VMI is counted there as any bound VMI, once.
//
// A hold whose migration never records its target is dropped by
// ReleaseMigration, or forgotten after reservationTTL.

// activeIndex indexes the migrations that hold a target node.
const activeIndex = "active"

// holdsTarget reports whether mig holds its target node: it has one and
// has not ended. A migration the nodes reported failed releases it at
// once; one they reported completed keeps it until the brain has moved
// the VMI.
func holdsTarget(mig *kubevirtv1.VirtualMachineInstanceMigration) bool {
	st := mig.Status.MigrationState
	return st != nil && st.TargetNode != "" && !migstate.Final(mig) && !(migstate.Ended(st) && st.Failed)
}

func (s *Scheduler) watchMigrations() error {
	if err := s.vmims.AddIndexers(cache.Indexers{activeIndex: func(obj any) ([]string, error) {
		if holdsTarget(obj.(*kubevirtv1.VirtualMachineInstanceMigration)) {
			return []string{activeIndex}, nil
		}
		return nil, nil
	}}); err != nil {
		return err
	}
	_, err := s.vmims.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { s.migrationRecorded(obj.(*kubevirtv1.VirtualMachineInstanceMigration)) },
		UpdateFunc: func(o, n any) {
			mig := n.(*kubevirtv1.VirtualMachineInstanceMigration)
			s.migrationRecorded(mig)
			// A migration that ends frees its target's capacity.
			if holdsTarget(o.(*kubevirtv1.VirtualMachineInstanceMigration)) && !holdsTarget(mig) {
				s.retryWaiting()
			}
		},
		DeleteFunc: func(any) { s.retryWaiting() },
	})
	return err
}

// migrationRecorded drops the hold DecideMigration took for mig's VMI once
// mig records that target: the migration holds it from then on.
func (s *Scheduler) migrationRecorded(mig *kubevirtv1.VirtualMachineInstanceMigration) {
	st := mig.Status.MigrationState
	if st == nil || st.TargetNode == "" {
		return
	}
	obj, ok, _ := s.vmis.GetStore().GetByKey(mig.Namespace + "/" + mig.Spec.VMIName)
	if !ok {
		return
	}
	uid := obj.(*kubevirtv1.VirtualMachineInstance).UID
	s.mu.Lock()
	if h, ok := s.holds[uid]; ok && h.node == st.TargetNode {
		delete(s.holds, uid)
	}
	s.mu.Unlock()
}

// DecideMigration picks the target node of a live migration of vmi, given
// as the migration must be placed (its selectors plus the migration's, the
// source excluded, without the volumes that are copied), with the checks
// and the capacity count of every other decision, and holds the VMI's
// requests on that node from now on (see above). It returns a *FitError
// when no node can take the VMI.
func (s *Scheduler) DecideMigration(vmi *kubevirtv1.VirtualMachineInstance) (string, error) {
	s.decideMu.Lock()
	defer s.decideMu.Unlock()
	s.mu.Lock()
	delete(s.holds, vmi.UID) // a new decision for the VMI replaces an old hold
	s.mu.Unlock()
	node, _, p, err := s.decide(vmi, nil) // no volumes: no snapshot to locate
	if err != nil {
		return "", err
	}
	s.mu.Lock()
	s.holds[vmi.UID] = reservation{assumption: assumption{node: node, p: p}, at: s.now()}
	s.mu.Unlock()
	return node, nil
}

// ReleaseMigration drops the hold DecideMigration took for the VMI uid,
// when its migration could not record the target.
func (s *Scheduler) ReleaseMigration(uid types.UID) {
	s.mu.Lock()
	delete(s.holds, uid)
	s.mu.Unlock()
	s.retryWaiting()
}

// addMigrating adds to the nodes of byName the VMIs migrating to them: the
// target node of each migration that holds one (its VMI neither gone nor
// already moved there), then each hold of DecideMigration whose migration
// has not recorded its target yet. It drops the holds the migrations took
// over and the expired ones. Callers hold memoMu.
func (s *Scheduler) addMigrating(byName map[string]*nodeState) {
	add := func(a assumption) {
		if st, ok := byName[a.node]; ok {
			st.add(a.p)
		}
	}
	recorded := map[types.UID]bool{}
	objs, _ := s.vmims.GetIndexer().ByIndex(activeIndex, activeIndex)
	for _, o := range objs {
		mig := o.(*kubevirtv1.VirtualMachineInstanceMigration)
		obj, ok, _ := s.vmis.GetStore().GetByKey(mig.Namespace + "/" + mig.Spec.VMIName)
		if !ok {
			continue
		}
		vmi := obj.(*kubevirtv1.VirtualMachineInstance)
		target := mig.Status.MigrationState.TargetNode
		recorded[vmi.UID] = true
		if vmi.IsFinal() || vmi.Status.NodeName == target {
			continue
		}
		add(assumption{node: target, p: s.placedOfLocked(vmi)})
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	for uid, h := range s.holds {
		if recorded[uid] || now.Sub(h.at) > reservationTTL {
			delete(s.holds, uid)
			continue
		}
		add(h.assumption)
	}
}
