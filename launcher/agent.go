package launcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"time"

	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/launcher/domain"
)

// QEMU guest agent calls, through libvirt's virDomainQemuAgentCommand on
// the domain's org.qemu.guest_agent.0 channel (see launcher/domain). The
// answers are turned into KubeVirt's API types, as virt-launcher's agent
// poller does.

// ErrAgentNotConnected is wrapped by agent calls to a domain whose guest
// agent is not (or no longer) connected, or does not answer.
var ErrAgentNotConnected = errors.New("guest agent is not connected")

// DefaultAgentTimeout bounds one agent call when the context has no
// earlier deadline.
const DefaultAgentTimeout = 10 * time.Second

func (m *Manager) onAgentLifecycle(_ *libvirt.Connect, d *libvirt.Domain, ev *libvirt.DomainEventAgentLifecycle) {
	name, err := d.GetName()
	if err != nil {
		m.log.Error("agent event without a domain name", "err", err)
		return
	}
	uuid, _ := d.GetUUIDString()
	e := Event{Domain: name, UUID: uuid, Type: EventAgentDisconnected}
	if ev.State == libvirt.CONNECT_DOMAIN_EVENT_AGENT_LIFECYCLE_STATE_CONNECTED {
		e.Type = EventAgentConnected
	}
	switch ev.Reason {
	case libvirt.CONNECT_DOMAIN_EVENT_AGENT_LIFECYCLE_REASON_DOMAIN_STARTED:
		e.Reason = "domain-started"
	case libvirt.CONNECT_DOMAIN_EVENT_AGENT_LIFECYCLE_REASON_CHANNEL:
		e.Reason = "channel"
	default:
		e.Reason = "unknown"
	}
	m.log.Debug("guest agent event", "domain", name, "event", e.Type.String(), "reason", e.Reason)
	m.queue.push(e)
	m.wake(name)
}

// AgentConnected reports whether the guest agent of the running domain is
// connected, as libvirt shows it in the live domain XML (the channel's
// target state). It needs no agent round trip.
func (m *Manager) AgentConnected(ctx context.Context, name string) (bool, error) {
	x, err := m.DomainXML(ctx, name)
	if err != nil {
		return false, err
	}
	return AgentChannelConnected(x), nil
}

// AgentChannelConnected reads the guest agent channel's state from a live
// domain XML: true when libvirt sees qemu-ga connected.
func AgentChannelConnected(x *libvirtxml.Domain) bool {
	if x == nil || x.Devices == nil {
		return false
	}
	for _, ch := range x.Devices.Channels {
		if t := ch.Target; t != nil && t.VirtIO != nil && t.VirtIO.Name == domain.GuestAgentChannel {
			return t.VirtIO.State == "connected"
		}
	}
	return false
}

// AgentCommand runs one guest agent command with its arguments (nil: none)
// and decodes the answer's "return" value into out (nil: ignored). The
// call waits at most until ctx's deadline or DefaultAgentTimeout.
func (m *Manager) AgentCommand(ctx context.Context, name, command string, args, out any) error {
	req := map[string]any{"execute": command}
	if args != nil {
		req["arguments"] = args
	}
	body, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("agent command %s: %w", command, err)
	}
	timeout := DefaultAgentTimeout
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < timeout {
		timeout = time.Until(dl)
	}
	secs := int(math.Ceil(timeout.Seconds()))
	if secs < 1 {
		return fmt.Errorf("agent command %s on %s: %w", command, name, context.DeadlineExceeded)
	}
	var answer string
	err = m.withDomain(name, func(d *libvirt.Domain) error {
		var cerr error
		answer, cerr = d.QemuAgentCommand(string(body), libvirt.DomainQemuAgentCommandTimeout(secs), 0)
		return cerr
	})
	if err != nil {
		switch libvirtCode(err) {
		case libvirt.ERR_AGENT_UNRESPONSIVE, libvirt.ERR_AGENT_UNSYNCED, libvirt.ERR_OPERATION_INVALID:
			return fmt.Errorf("agent command %s on %s: %w: %w", command, name, ErrAgentNotConnected, err)
		}
		return fmt.Errorf("agent command %s on %s: %w", command, name, err)
	}
	var reply struct {
		Return json.RawMessage `json:"return"`
		Error  *struct {
			Class string `json:"class"`
			Desc  string `json:"desc"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(answer), &reply); err != nil {
		return fmt.Errorf("agent command %s on %s: answer: %w", command, name, err)
	}
	if reply.Error != nil {
		return fmt.Errorf("agent command %s on %s: %s: %s", command, name, reply.Error.Class, reply.Error.Desc)
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(reply.Return, out); err != nil {
		return fmt.Errorf("agent command %s on %s: answer: %w", command, name, err)
	}
	return nil
}

// The guest agent's answers (QEMU's qga/qapi-schema.json), as far as
// nodevirt reads them.
type (
	agentInfo struct {
		Version           string `json:"version"`
		SupportedCommands []struct {
			Name    string `json:"name"`
			Enabled bool   `json:"enabled"`
		} `json:"supported_commands"`
	}
	agentOSInfo struct {
		ID            string `json:"id"`
		Name          string `json:"name"`
		PrettyName    string `json:"pretty-name"`
		Version       string `json:"version"`
		VersionID     string `json:"version-id"`
		KernelRelease string `json:"kernel-release"`
		KernelVersion string `json:"kernel-version"`
		Machine       string `json:"machine"`
	}
	agentUser struct {
		User      string  `json:"user"`
		Domain    string  `json:"domain"`
		LoginTime float64 `json:"login-time"`
	}
	agentFS struct {
		Name       string `json:"name"`
		Mountpoint string `json:"mountpoint"`
		Type       string `json:"type"`
		UsedBytes  *int64 `json:"used-bytes"`
		TotalBytes *int64 `json:"total-bytes"`
		Disk       []struct {
			BusType string `json:"bus-type"`
			Serial  string `json:"serial"`
		} `json:"disk"`
	}
	agentInterface struct {
		Name            string `json:"name"`
		HardwareAddress string `json:"hardware-address"`
		IPAddresses     []struct {
			Type    string `json:"ip-address-type"`
			Address string `json:"ip-address"`
			Prefix  int    `json:"prefix"`
		} `json:"ip-addresses"`
	}
)

// GuestOSInfo asks the agent for the guest's operating system
// (guest-get-osinfo).
func (m *Manager) GuestOSInfo(ctx context.Context, name string) (v1.VirtualMachineInstanceGuestOSInfo, error) {
	var os agentOSInfo
	if err := m.AgentCommand(ctx, name, "guest-get-osinfo", nil, &os); err != nil {
		return v1.VirtualMachineInstanceGuestOSInfo{}, err
	}
	return v1.VirtualMachineInstanceGuestOSInfo{
		Name: os.Name, ID: os.ID, PrettyName: os.PrettyName, Version: os.Version, VersionID: os.VersionID,
		KernelRelease: os.KernelRelease, KernelVersion: os.KernelVersion, Machine: os.Machine,
	}, nil
}

// GuestUsers lists the users logged in to the guest (guest-get-users).
func (m *Manager) GuestUsers(ctx context.Context, name string) ([]v1.VirtualMachineInstanceGuestOSUser, error) {
	var users []agentUser
	if err := m.AgentCommand(ctx, name, "guest-get-users", nil, &users); err != nil {
		return nil, err
	}
	out := make([]v1.VirtualMachineInstanceGuestOSUser, 0, len(users))
	for _, u := range users {
		out = append(out, v1.VirtualMachineInstanceGuestOSUser{UserName: u.User, Domain: u.Domain, LoginTime: u.LoginTime})
	}
	return out, nil
}

// GuestFileSystems lists the guest's mounted filesystems with their usage
// and disks (guest-get-fsinfo).
func (m *Manager) GuestFileSystems(ctx context.Context, name string) ([]v1.VirtualMachineInstanceFileSystem, error) {
	var fss []agentFS
	if err := m.AgentCommand(ctx, name, "guest-get-fsinfo", nil, &fss); err != nil {
		return nil, err
	}
	out := make([]v1.VirtualMachineInstanceFileSystem, 0, len(fss))
	for _, fs := range fss {
		f := v1.VirtualMachineInstanceFileSystem{DiskName: fs.Name, MountPoint: fs.Mountpoint, FileSystemType: fs.Type}
		if fs.UsedBytes != nil {
			f.UsedBytes = int(*fs.UsedBytes)
		}
		if fs.TotalBytes != nil {
			f.TotalBytes = int(*fs.TotalBytes)
		}
		for _, d := range fs.Disk {
			f.Disk = append(f.Disk, v1.VirtualMachineInstanceFileSystemDisk{BusType: d.BusType, Serial: d.Serial})
		}
		out = append(out, f)
	}
	return out, nil
}

// GuestAgentVersion asks the agent for its version and the commands it
// supports (guest-info).
func (m *Manager) GuestAgentVersion(ctx context.Context, name string) (string, []v1.GuestAgentCommandInfo, error) {
	var ga agentInfo
	if err := m.AgentCommand(ctx, name, "guest-info", nil, &ga); err != nil {
		return "", nil, err
	}
	var cmds []v1.GuestAgentCommandInfo
	for _, c := range ga.SupportedCommands {
		cmds = append(cmds, v1.GuestAgentCommandInfo{Name: c.Name, Enabled: c.Enabled})
	}
	return ga.Version, cmds, nil
}

// GuestAgentInfo gathers what `virtctl guestosinfo` shows: the agent's
// version and commands (guest-info), host name, operating system, time
// zone, users and filesystems. A command the agent lacks or refuses leaves
// its part empty; only a lost agent is an error.
func (m *Manager) GuestAgentInfo(ctx context.Context, name string) (*v1.VirtualMachineInstanceGuestAgentInfo, error) {
	version, cmds, err := m.GuestAgentVersion(ctx, name)
	if err != nil {
		return nil, err
	}
	info := &v1.VirtualMachineInstanceGuestAgentInfo{GAVersion: version, SupportedCommands: cmds}
	partial := func(err error) error {
		if errors.Is(err, ErrAgentNotConnected) {
			return err
		}
		if err != nil {
			m.log.Debug("guest agent command failed", "domain", name, "err", err)
		}
		return nil
	}
	var host struct {
		HostName string `json:"host-name"`
	}
	if err := partial(m.AgentCommand(ctx, name, "guest-get-host-name", nil, &host)); err != nil {
		return nil, err
	}
	info.Hostname = host.HostName
	os, err := m.GuestOSInfo(ctx, name)
	if err := partial(err); err != nil {
		return nil, err
	}
	info.OS = os
	var tz struct {
		Zone   string `json:"zone"`
		Offset int    `json:"offset"`
	}
	if err := partial(m.AgentCommand(ctx, name, "guest-get-timezone", nil, &tz)); err != nil {
		return nil, err
	}
	if tz.Zone != "" || tz.Offset != 0 {
		// KubeVirt's form: "<zone>, <offset in seconds>".
		info.Timezone = tz.Zone + ", " + strconv.Itoa(tz.Offset)
	}
	users, err := m.GuestUsers(ctx, name)
	if err := partial(err); err != nil {
		return nil, err
	}
	info.UserList = users
	fss, err := m.GuestFileSystems(ctx, name)
	if err := partial(err); err != nil {
		return nil, err
	}
	info.FSInfo.Filesystems = fss
	var freeze string
	if err := partial(m.AgentCommand(ctx, name, "guest-fsfreeze-status", nil, &freeze)); err != nil {
		return nil, err
	}
	if freeze == "frozen" {
		// KubeVirt shows only a frozen state; thawed is the normal one.
		info.FSFreezeStatus = freeze
	}
	return info, nil
}

// GuestInterface is one guest network interface as the agent reports it.
type GuestInterface struct {
	// Name is the guest's name for it (eth0).
	Name string
	// MAC is its hardware address, lower case.
	MAC string
	// IP is its primary address: the first IPv4 address, else the first.
	IP string
	// IPs are its addresses without prefix, in the agent's order;
	// link-local and loopback addresses are left out.
	IPs []string
}

// GuestInterfaces lists the guest's network interfaces and addresses
// (guest-network-get-interfaces), loopback left out.
func (m *Manager) GuestInterfaces(ctx context.Context, name string) ([]GuestInterface, error) {
	var ifs []agentInterface
	if err := m.AgentCommand(ctx, name, "guest-network-get-interfaces", nil, &ifs); err != nil {
		return nil, err
	}
	return guestInterfaces(ifs), nil
}

func guestInterfaces(ifs []agentInterface) []GuestInterface {
	var out []GuestInterface
	for _, i := range ifs {
		if i.Name == "lo" {
			continue
		}
		gi := GuestInterface{Name: i.Name, MAC: i.HardwareAddress}
		if hw, err := net.ParseMAC(i.HardwareAddress); err == nil {
			gi.MAC = hw.String()
		}
		for _, a := range i.IPAddresses {
			ip := net.ParseIP(a.Address)
			if ip == nil || ip.IsLinkLocalUnicast() || ip.IsLoopback() {
				continue
			}
			gi.IPs = append(gi.IPs, ip.String())
			if gi.IP == "" && ip.To4() != nil {
				gi.IP = ip.String()
			}
		}
		if gi.IP == "" && len(gi.IPs) > 0 {
			gi.IP = gi.IPs[0]
		}
		out = append(out, gi)
	}
	return out
}
