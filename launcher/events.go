package launcher

import (
	"fmt"
	"sync"

	"libvirt.org/go/libvirt"
)

// State is a domain's state as libvirt reports it.
type State int

// The states of a domain.
const (
	StateNoState State = iota
	StateRunning
	StateBlocked
	StatePaused
	StateShuttingDown
	StateShutoff
	StateCrashed
	StatePMSuspended
)

var stateNames = [...]string{"nostate", "running", "blocked", "paused", "shutting-down", "shutoff", "crashed", "pmsuspended"}

func (s State) String() string {
	if s >= 0 && int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("state-%d", int(s))
}

// Active reports whether a QEMU process exists for the domain.
func (s State) Active() bool {
	switch s {
	case StateRunning, StateBlocked, StatePaused, StateShuttingDown, StatePMSuspended:
		return true
	}
	return false
}

// EventType is the kind of a lifecycle event.
type EventType int

// Lifecycle events: libvirt's, plus EventReconnected.
const (
	EventDefined EventType = iota
	EventUndefined
	EventStarted
	EventSuspended
	EventResumed
	EventStopped
	EventShutdown
	EventPMSuspended
	EventCrashed
	// EventReconnected is nodevirt's: the connection to libvirtd was lost
	// and made again. Events may have been missed meanwhile: consumers
	// re-read every domain's state (List). Domain is empty.
	EventReconnected EventType = 100
	// EventAgentConnected and EventAgentDisconnected are libvirt's guest
	// agent lifecycle events (VIR_DOMAIN_EVENT_ID_AGENT_LIFECYCLE): qemu-ga
	// opened or closed the domain's org.qemu.guest_agent.0 channel. Reason
	// is "domain-started", "channel" or "unknown"; State is not known
	// (StateNoState): the domain's state did not change.
	EventAgentConnected    EventType = 101
	EventAgentDisconnected EventType = 102
)

var eventNames = map[EventType]string{
	EventDefined: "defined", EventUndefined: "undefined", EventStarted: "started", EventSuspended: "suspended",
	EventResumed: "resumed", EventStopped: "stopped", EventShutdown: "shutdown", EventPMSuspended: "pmsuspended",
	EventCrashed: "crashed", EventReconnected: "reconnected",
	EventAgentConnected: "agent-connected", EventAgentDisconnected: "agent-disconnected",
}

func (t EventType) String() string {
	if n, ok := eventNames[t]; ok {
		return n
	}
	return fmt.Sprintf("event-%d", int(t))
}

// Event is one lifecycle event of a domain.
type Event struct {
	// Domain is the domain's name (namespace_name for nodevirt's domains).
	Domain string
	UUID   string
	Type   EventType
	// Reason is libvirt's detail of the event in words, e.g. "booted",
	// "paused", "shutdown" (the guest powered off), "destroyed", "crashed",
	// "failed" (QEMU died), "finished" (guest shutdown completed).
	Reason string
	// State is the state the event leaves the domain in.
	State State
}

func (e Event) String() string {
	return fmt.Sprintf("%s %s (%s) -> %s", e.Domain, e.Type, e.Reason, e.State)
}

var eventDetails = map[EventType][]string{
	EventDefined:     {"added", "updated", "renamed", "from-snapshot"},
	EventUndefined:   {"removed", "renamed"},
	EventStarted:     {"booted", "migrated", "restored", "from-snapshot", "wakeup"},
	EventSuspended:   {"paused", "migrated", "ioerror", "watchdog", "restored", "from-snapshot", "api-error", "postcopy", "postcopy-failed"},
	EventResumed:     {"unpaused", "migrated", "from-snapshot", "postcopy", "postcopy-failed"},
	EventStopped:     {"shutdown", "destroyed", "crashed", "migrated", "saved", "failed", "from-snapshot"},
	EventShutdown:    {"finished", "guest", "host"},
	EventPMSuspended: {"memory", "disk"},
	EventCrashed:     {"panicked", "crashloaded"},
}

var eventStates = map[EventType]State{
	EventStarted: StateRunning, EventSuspended: StatePaused, EventResumed: StateRunning,
	EventStopped: StateShutoff, EventShutdown: StateShuttingDown, EventPMSuspended: StatePMSuspended,
	EventCrashed: StateCrashed, EventDefined: StateShutoff, EventUndefined: StateNoState,
}

func newEvent(name, uuid string, ev *libvirt.DomainEventLifecycle) Event {
	t := EventType(ev.Event)
	e := Event{Domain: name, UUID: uuid, Type: t, State: eventStates[t]}
	if d := eventDetails[t]; ev.Detail >= 0 && ev.Detail < len(d) {
		e.Reason = d[ev.Detail]
	} else {
		e.Reason = fmt.Sprintf("detail-%d", ev.Detail)
	}
	return e
}

var stateReasons = map[State][]string{
	StateRunning:      {"unknown", "booted", "migrated", "restored", "from-snapshot", "unpaused", "migration-canceled", "save-canceled", "wakeup", "crashed", "postcopy", "postcopy-failed"},
	StatePaused:       {"unknown", "user", "migration", "save", "dump", "ioerror", "watchdog", "from-snapshot", "shutting-down", "snapshot", "crashed", "starting-up", "postcopy", "postcopy-failed", "api-error"},
	StateShuttingDown: {"unknown", "user"},
	StateShutoff:      {"unknown", "shutdown", "destroyed", "crashed", "migrated", "saved", "failed", "from-snapshot", "daemon"},
	StateCrashed:      {"unknown", "panicked"},
	StateBlocked:      {"unknown"},
	StatePMSuspended:  {"unknown"},
}

func stateReason(s State, reason int) string {
	if r := stateReasons[s]; reason >= 0 && reason < len(r) {
		return r[reason]
	}
	return fmt.Sprintf("reason-%d", reason)
}

// eventQueue hands events from libvirt's event loop to one consumer without
// ever blocking the loop and without dropping events.
type eventQueue struct {
	mu      sync.Mutex
	pending []Event
	wake    chan struct{}
	out     chan Event
}

func newEventQueue() *eventQueue {
	return &eventQueue{wake: make(chan struct{}, 1), out: make(chan Event)}
}

func (q *eventQueue) push(e Event) {
	q.mu.Lock()
	q.pending = append(q.pending, e)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// run forwards queued events to out until done closes, then closes out.
func (q *eventQueue) run(done <-chan struct{}) {
	defer close(q.out)
	for {
		q.mu.Lock()
		batch := q.pending
		q.pending = nil
		q.mu.Unlock()
		for _, e := range batch {
			select {
			case q.out <- e:
			case <-done:
				return
			}
		}
		select {
		case <-q.wake:
		case <-done:
			return
		}
	}
}
