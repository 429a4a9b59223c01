// Package fencing is the contract between the node agents and the brain
// for hosts that fail. It depends on neither daemon.
//
// Timeline, from a node's last successful Lease renewal (T):
//
//   - The agent renews its Lease in kube-node-lease every heartbeat (10 s)
//     together with its Ready condition.
//   - T + Grace: the brain marks the Node Ready=Unknown and taints it
//     node.kubernetes.io/unreachable (NoSchedule and NoExecute), as
//     Kubernetes' node lifecycle controller does; a Node whose agent
//     reports Ready=False is tainted node.kubernetes.io/not-ready. Nothing
//     new is scheduled there. A fresh renewal lifts the taints.
//   - T + Window: an agent that could not renew for that long, and that
//     reaches none of its peers either, for a few seconds in a row (so it
//     is the one cut off, not the API server that is down for everyone,
//     nor a peer too busy to answer one connect), stops its guests
//     (self-fencing, --self-fence=stop, the default; "none" disables it).
//   - T + Window + Margin: the brain marks the node's VMIs Failed with
//     reason NodeUnreachable (an event on the VM says so) and releases them
//     (drops the node agent's finalizer): the VM's runStrategy starts a new
//     VMI, which the scheduler places on another node when its volumes can
//     run there; one pinned by a node-local volume waits, Unschedulable,
//     naming the volume.
//   - A node tainted node.kubernetes.io/out-of-service (an administrator's
//     "this host is powered off") is failed over at once.
//   - A node that comes back finds its domains' VMIs gone or placed
//     elsewhere: it undefines those domains and never starts them again.
//
// Both sides read the window from their own flag; the brain's must not be
// shorter than the agents'. The margin covers clock skew and the time the
// agent takes to stop its guests.
package fencing

import "time"

// Defaults of the timeline.
const (
	DefaultGrace  = 20 * time.Second
	DefaultWindow = 30 * time.Second
	DefaultMargin = 10 * time.Second
)

// Self-fencing modes of the node agent.
const (
	ModeStop = "stop"
	ModeNone = "none"
)

// Names on the API.
const (
	// ReasonNodeUnreachable is the VMI's status.reason and the VM event's
	// reason when the brain fails a VMI over.
	ReasonNodeUnreachable = "NodeUnreachable"
	// TaintOutOfService fails a node over at once.
	TaintOutOfService = "node.kubernetes.io/out-of-service"
	// HandlerFinalizer is the node agent's finalizer on VMIs, which the
	// brain drops from the VMIs of a lost node.
	HandlerFinalizer = "nodevirt.io/virt-handler"
)

// Lost says whether a node whose Lease was last renewed at renewed is lost
// at now: past window + margin, or out of service.
func Lost(now, renewed time.Time, window, margin time.Duration, outOfService bool) bool {
	return outOfService || now.Sub(renewed) > window+margin
}

// ShouldFence says whether an agent that last renewed its Lease at renewed
// stops its guests at now: past the window, and cut off from every peer it
// knows. An agent that knows no peer never fences: no other node could
// start its guests, so there is no second copy to prevent, and a slow or
// restarting API server must not stop a one-node cluster's VMs.
func ShouldFence(now, renewed time.Time, window time.Duration, peers, reachable int) bool {
	if now.Sub(renewed) <= window || peers == 0 {
		return false
	}
	return reachable == 0
}
