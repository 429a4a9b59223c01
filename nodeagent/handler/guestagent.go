package handler

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/nodeagent/console"
)

// The QEMU guest agent, as virt-handler and virt-launcher's agent poller
// treat it: libvirt tells when qemu-ga connects to the domain's
// org.qemu.guest_agent.0 channel and when it goes (an agent lifecycle
// event, which reconciles the VMI); while it is connected the VMI has the
// AgentConnected condition, and status.guestOSInfo and the interfaces'
// guest addresses are read from it at once and then every
// Config.AgentPollInterval. Without an agent nothing is polled.

// DefaultAgentPollInterval is how often a connected agent is asked again.
const DefaultAgentPollInterval = 30 * time.Second

// agentStatusTimeout bounds each agent call made for the VMI's status.
const agentStatusTimeout = 5 * time.Second

// agentDue reports whether the VMI's agent should be asked now, and
// whether it is the first time since it connected; it records that it is
// being asked.
func (h *Handler) agentDue(vmi *v1.VirtualMachineInstance) (due, first bool) {
	key := vmi.Namespace + "/" + vmi.Name
	h.mu.Lock()
	defer h.mu.Unlock()
	last, ok := h.agentPolled[key]
	if ok && last.uid == vmi.UID && time.Since(last.at) < h.cfg.AgentPollInterval {
		return false, false
	}
	h.agentPolled[key] = agentPoll{uid: vmi.UID, at: time.Now()}
	return true, !ok || last.uid != vmi.UID
}

// requiredAgentCommands are the agent commands KubeVirt expects of a
// supported guest agent; an agent that lists its commands and lacks one of
// these gets the UnsupportedAgent condition.
var requiredAgentCommands = []string{
	"guest-ping", "guest-get-time", "guest-info", "guest-shutdown", "guest-network-get-interfaces",
	"guest-get-fsinfo", "guest-get-host-name", "guest-get-users", "guest-get-timezone", "guest-get-osinfo",
}

// agentSupport sets or clears the UnsupportedAgent condition from the
// commands the agent lists (guest-info).
func agentSupport(out *v1.VirtualMachineInstance, cmds []v1.GuestAgentCommandInfo) {
	if len(cmds) == 0 {
		return // an agent that lists nothing is not judged
	}
	enabled := map[string]bool{}
	for _, c := range cmds {
		enabled[c.Name] = c.Enabled
	}
	var missing []string
	for _, c := range requiredAgentCommands {
		if !enabled[c] {
			missing = append(missing, c)
		}
	}
	if len(missing) == 0 {
		removeCondition(out, v1.VirtualMachineInstanceUnsupportedAgent)
		return
	}
	setCondition(out, v1.VirtualMachineInstanceUnsupportedAgent, true, "This guest agent doesn't support required basic commands",
		"missing or disabled: "+strings.Join(missing, ", "))
}

// forgetAgent makes the next reconcile with a connected agent ask it
// (after the agent reconnected, or the domain stopped).
func (h *Handler) forgetAgent(vmi *v1.VirtualMachineInstance) {
	h.forgetAgentKey(vmi.Namespace + "/" + vmi.Name)
}

func (h *Handler) forgetAgentKey(key string) {
	h.mu.Lock()
	delete(h.agentPolled, key)
	h.mu.Unlock()
}

// observeAgent sets the AgentConnected condition and, when the agent is
// due, status.guestOSInfo. It returns the guest's interfaces for
// interfaceStatus: nil when the agent was not asked this time, empty when
// there is no agent.
func (h *Handler) observeAgent(ctx context.Context, lv *launcher.Manager, vmi, out *v1.VirtualMachineInstance,
	info launcher.DomainInfo, x *libvirtxml.Domain) []launcher.GuestInterface {
	if !launcher.AgentChannelConnected(x) {
		removeCondition(out, v1.VirtualMachineInstanceAgentConnected)
		removeCondition(out, v1.VirtualMachineInstanceUnsupportedAgent)
		h.forgetAgent(vmi)
		return []launcher.GuestInterface{}
	}
	setCondition(out, v1.VirtualMachineInstanceAgentConnected, true, "", "")
	if info.State != launcher.StateRunning {
		// A paused guest's agent cannot answer; it is asked after unpause.
		return nil
	}
	due, first := h.agentDue(vmi)
	if !due {
		return nil
	}
	log := h.log.With("vmi", vmi.Namespace+"/"+vmi.Name)
	key := vmi.Namespace + "/" + vmi.Name
	h.queue.AddAfter(key, h.cfg.AgentPollInterval)
	// A hung agent must not hold a reconcile worker for long.
	ctx, cancel := context.WithTimeout(ctx, agentStatusTimeout)
	defer cancel()
	if first {
		// The agent's command list does not change while it runs.
		_, cmds, err := lv.GuestAgentVersion(ctx, info.Name)
		if err != nil {
			log.Info("guest agent: info", "err", err)
			h.forgetAgent(vmi) // judged on the next poll
			return nil
		}
		agentSupport(out, cmds)
	}
	osInfo, err := lv.GuestOSInfo(ctx, info.Name)
	if err != nil {
		log.Info("guest agent: os info", "err", err)
		return nil
	}
	out.Status.GuestOSInfo = osInfo
	ifs, err := lv.GuestInterfaces(ctx, info.Name)
	if err != nil {
		log.Info("guest agent: interfaces", "err", err)
		return nil
	}
	if ifs == nil {
		ifs = []launcher.GuestInterface{}
	}
	return ifs
}

// agentDomain finds the running domain of a VMI whose agent is connected.
func (h *Handler) agentDomain(ctx context.Context, namespace, name string) (*launcher.Manager, string, error) {
	_, lv, dom, err := h.running(ctx, namespace, name)
	if err != nil {
		return nil, "", err
	}
	ok, err := lv.AgentConnected(ctx, dom)
	if err != nil {
		return nil, "", err
	}
	if !ok {
		return nil, "", fmt.Errorf("%w: %s/%s", console.ErrNoGuestAgent, namespace, name)
	}
	return lv, dom, nil
}

// agentErr maps a lost agent to the console server's error.
func agentErr(err error) error {
	if errors.Is(err, launcher.ErrAgentNotConnected) {
		return fmt.Errorf("%w: %w", console.ErrNoGuestAgent, err)
	}
	return err
}

// GuestOSInfo answers `virtctl guestosinfo` from the VMI's guest agent.
func (h *Handler) GuestOSInfo(ctx context.Context, namespace, name string) (*v1.VirtualMachineInstanceGuestAgentInfo, error) {
	lv, dom, err := h.agentDomain(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	info, err := lv.GuestAgentInfo(ctx, dom)
	if err != nil {
		return nil, agentErr(err)
	}
	return info, nil
}

// UserList answers `virtctl userlist`.
func (h *Handler) UserList(ctx context.Context, namespace, name string) (*v1.VirtualMachineInstanceGuestOSUserList, error) {
	lv, dom, err := h.agentDomain(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	users, err := lv.GuestUsers(ctx, dom)
	if err != nil {
		return nil, agentErr(err)
	}
	return &v1.VirtualMachineInstanceGuestOSUserList{Items: users}, nil
}

// FileSystemList answers `virtctl fslist`.
func (h *Handler) FileSystemList(ctx context.Context, namespace, name string) (*v1.VirtualMachineInstanceFileSystemList, error) {
	lv, dom, err := h.agentDomain(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	fss, err := lv.GuestFileSystems(ctx, dom)
	if err != nil {
		return nil, agentErr(err)
	}
	return &v1.VirtualMachineInstanceFileSystemList{Items: fss}, nil
}

// Freeze freezes the guest's file systems through its agent (the first
// step of an online snapshot, or the freeze subresource); they are thawed
// by Unfreeze or, as KubeVirt's unfreezeTimeout does, after
// unfreezeTimeout (never when 0).
func (h *Handler) Freeze(ctx context.Context, namespace, name string, unfreezeTimeout time.Duration) error {
	lv, dom, err := h.agentDomain(ctx, namespace, name)
	if err != nil {
		return err
	}
	var frozen int
	if err := lv.AgentCommand(ctx, dom, "guest-fsfreeze-freeze", nil, &frozen); err != nil {
		return agentErr(err)
	}
	key := namespace + "/" + name
	h.mu.Lock()
	if t := h.thaws[key]; t != nil {
		t.Stop()
		delete(h.thaws, key)
	}
	if h.thaws == nil {
		h.thaws = map[string]*time.Timer{}
	}
	if unfreezeTimeout <= 0 {
		h.mu.Unlock()
		h.log.Info("guest file systems frozen", "vmi", key, "filesystems", frozen, "unfreezeTimeout", "none")
		return nil
	}
	h.thaws[key] = time.AfterFunc(unfreezeTimeout, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := h.Unfreeze(ctx, namespace, name); err != nil {
			h.log.Warn("thaw after the freeze timeout", "vmi", key, "err", err)
		}
	})
	h.mu.Unlock()
	h.log.Info("guest file systems frozen", "vmi", key, "filesystems", frozen, "unfreezeTimeout", unfreezeTimeout)
	return nil
}

// Unfreeze thaws the guest's file systems; thawing a guest that is not
// frozen succeeds.
func (h *Handler) Unfreeze(ctx context.Context, namespace, name string) error {
	key := namespace + "/" + name
	h.mu.Lock()
	if t := h.thaws[key]; t != nil {
		t.Stop()
		delete(h.thaws, key)
	}
	h.mu.Unlock()
	lv, dom, err := h.agentDomain(ctx, namespace, name)
	if err != nil {
		return err
	}
	var thawed int
	if err := lv.AgentCommand(ctx, dom, "guest-fsfreeze-thaw", nil, &thawed); err != nil {
		return agentErr(err)
	}
	h.log.Info("guest file systems thawed", "vmi", key, "filesystems", thawed)
	return nil
}
