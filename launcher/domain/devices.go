package domain

import (
	"fmt"
	"net"

	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"
)

var nicModels = map[string]bool{
	"virtio": true, "e1000": true, "e1000e": true, "igb": true, "ne2k_pci": true, "pcnet": true, "rtl8139": true,
}

// interfaces makes one unmanaged ethernet interface per bridge or masquerade
// NIC, on the tap the node prepared for it: libvirt only opens the tap, all
// plumbing (bridge port, NAT for masquerade, spoof checks) is the node's.
// spec.domain.devices.interfaces[].ports is consumed by that node code too.
func (c *converter) interfaces(d *libvirtxml.Domain) {
	devs := &c.spec.Domain.Devices
	transitional := devs.UseVirtioTransitional != nil && *devs.UseVirtioTransitional
	networks := map[string]*v1.Network{}
	for i := range c.spec.Networks {
		n := &c.spec.Networks[i]
		networks[n.Name] = n
		if n.ResourceClaim != nil {
			c.refuse(fmt.Sprintf("spec.networks[%d].resourceClaim", i), "not supported")
		}
	}
	if devs.NetworkInterfaceMultiQueue != nil && *devs.NetworkInterfaceMultiQueue {
		c.refuse("spec.domain.devices.networkInterfaceMultiqueue", "not supported")
	}
	for i := range devs.Interfaces {
		iface := &devs.Interfaces[i]
		path := fmt.Sprintf("spec.domain.devices.interfaces[%d]", i)
		if _, ok := networks[iface.Name]; !ok {
			c.invalid(path+".name", "no network named %q in spec.networks", iface.Name)
		}
		b := &iface.InterfaceBindingMethod
		switch {
		case b.Bridge != nil, b.Masquerade != nil:
		case b.SRIOV != nil:
			c.refuse(path+".sriov", "not supported")
		case b.DeprecatedSlirp != nil:
			c.refuse(path+".slirp", "not supported")
		case b.DeprecatedMacvtap != nil:
			c.refuse(path+".macvtap", "not supported")
		case b.DeprecatedPasst != nil:
			c.refuse(path+".passt", "not supported")
		case b.PasstBinding != nil:
			c.refuse(path+".passtBinding", "not supported")
		case iface.Binding != nil:
			c.refuse(path+".binding", "network binding plugins are not supported")
		default:
			c.invalid(path, "no binding method (bridge or masquerade)")
		}
		if iface.DHCPOptions != nil {
			c.refuse(path+".dhcpOptions", "not supported")
		}
		if iface.Tag != "" {
			c.refuse(path+".tag", "not supported")
		}
		if iface.State == v1.InterfaceStateAbsent {
			continue
		}
		model := iface.Model
		if model == "" {
			model = "virtio"
		}
		if !nicModels[model] {
			c.invalid(path+".model", "unknown model %q", model)
		}
		if model == "virtio" && transitional {
			model = "virtio-transitional"
		}
		tap, ok := c.env.Taps[iface.Name]
		if !ok || tap.Dev == "" {
			c.fail(fmt.Errorf("%s: no tap device for interface %q on this node", path, iface.Name))
			continue
		}
		di := libvirtxml.DomainInterface{
			Source: &libvirtxml.DomainInterfaceSource{Ethernet: &libvirtxml.DomainInterfaceSourceEthernet{}},
			Target: &libvirtxml.DomainInterfaceTarget{Dev: tap.Dev, Managed: "no"},
			Model:  &libvirtxml.DomainInterfaceModel{Type: model},
			Alias:  userAlias(iface.Name),
		}
		if iface.MacAddress != "" {
			mac, err := net.ParseMAC(iface.MacAddress)
			if err != nil || len(mac) != 6 {
				c.invalid(path+".macAddress", "%q is not a MAC-48 address", iface.MacAddress)
			} else {
				di.MAC = &libvirtxml.DomainInterfaceMAC{Address: mac.String()}
			}
		}
		if tap.MAC != "" {
			mac, err := net.ParseMAC(tap.MAC)
			switch {
			case err != nil || len(mac) != 6:
				c.fail(fmt.Errorf("%s: tap %s has MAC %q, not a MAC-48 address", path, tap.Dev, tap.MAC))
			case di.MAC != nil && di.MAC.Address != mac.String():
				c.fail(fmt.Errorf("%s: tap %s was attached for MAC %s, not the spec's %s", path, tap.Dev, mac, di.MAC.Address))
			default:
				di.MAC = &libvirtxml.DomainInterfaceMAC{Address: mac.String()}
			}
		}
		if tap.MTU > 0 {
			di.MTU = &libvirtxml.DomainInterfaceMTU{Size: uint(tap.MTU)}
		}
		if iface.BootOrder != nil {
			if *iface.BootOrder == 0 {
				c.invalid(path+".bootOrder", "must be at least 1")
			}
			di.Boot = &libvirtxml.DomainDeviceBoot{Order: *iface.BootOrder}
		}
		if iface.PciAddress != "" {
			di.Address = c.pciAddress(path+".pciAddress", iface.PciAddress)
		}
		if iface.ACPIIndex > 0 {
			di.ACPI = &libvirtxml.DomainDeviceACPI{Index: uint(iface.ACPIIndex)}
		}
		switch iface.State {
		case "", v1.InterfaceStateLinkUp:
		case v1.InterfaceStateLinkDown:
			di.Link = &libvirtxml.DomainInterfaceLink{State: "down"}
		default:
			c.invalid(path+".state", "unknown state %q", iface.State)
		}
		d.Devices.Interfaces = append(d.Devices.Interfaces, di)
	}
}

func isTrue(b *bool) bool   { return b != nil && *b }
func notFalse(b *bool) bool { return b == nil || *b }
func uintPtr(u uint) *uint  { return &u }
func virtioModel(t bool) string {
	if t {
		return "virtio-transitional"
	}
	return "virtio"
}

// GuestAgentChannel is the virtio-serial port name QEMU's guest agent
// (qemu-ga) opens inside the guest.
const GuestAgentChannel = "org.qemu.guest_agent.0"

// devices adds the remaining devices: guest agent channel, serial console,
// VNC, input, video, balloon, rng, watchdog, panic, sound; and refuses the
// rest.
func (c *converter) devices(d *libvirtxml.Domain) {
	const path = "spec.domain.devices"
	devs := &c.spec.Domain.Devices
	dl := d.Devices
	transitional := isTrue(devs.UseVirtioTransitional)

	// Every domain gets the guest agent's channel, as KubeVirt's do; the
	// socket is libvirt's (a path it chooses in the domain's private
	// directory), and libvirt reports the agent connecting and going.
	dl.Channels = append(dl.Channels, libvirtxml.DomainChannel{
		Source: &libvirtxml.DomainChardevSource{UNIX: &libvirtxml.DomainChardevSourceUNIX{Mode: "bind"}},
		Target: &libvirtxml.DomainChannelTarget{VirtIO: &libvirtxml.DomainChannelTargetVirtIO{Name: GuestAgentChannel}},
	})

	if notFalse(devs.AutoattachSerialConsole) {
		serial := libvirtxml.DomainSerial{
			Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}},
			Target: &libvirtxml.DomainSerialTarget{Type: "isa-serial", Port: uintPtr(0)},
		}
		if isTrue(devs.LogSerialConsole) {
			serial.Log = &libvirtxml.DomainChardevLog{File: c.env.SerialLogPath(), Append: "on"}
		}
		dl.Serials = append(dl.Serials, serial)
		dl.Consoles = append(dl.Consoles, libvirtxml.DomainConsole{
			Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}},
			Target: &libvirtxml.DomainConsoleTarget{Type: "serial", Port: uintPtr(0)},
		})
	} else if isTrue(devs.LogSerialConsole) {
		c.invalid(path+".logSerialConsole", "needs the serial console (autoattachSerialConsole)")
	}

	if notFalse(devs.AutoattachGraphicsDevice) {
		// VNC on a unix socket that libvirt places in the domain's private
		// directory, where QEMU (running as the qemu user) may create it; the
		// live domain XML names the path.
		dl.Graphics = append(dl.Graphics, libvirtxml.DomainGraphic{VNC: &libvirtxml.DomainGraphicVNC{
			Listeners: []libvirtxml.DomainGraphicListener{{Socket: &libvirtxml.DomainGraphicListenerSocket{}}},
		}})
		video := "vga"
		if fw := c.spec.Domain.Firmware; fw != nil && fw.Bootloader != nil && fw.Bootloader.EFI != nil {
			video = "bochs"
		}
		if v := devs.Video; v != nil && v.Type != "" {
			switch v.Type {
			case "vga", "cirrus", "virtio", "bochs", "ramfb":
				video = v.Type
			default:
				c.invalid(path+".video.type", "unknown type %q", v.Type)
			}
		}
		dl.Videos = append(dl.Videos, libvirtxml.DomainVideo{Model: libvirtxml.DomainVideoModel{Type: video, Heads: 1}})
	} else if devs.Video != nil {
		c.invalid(path+".video", "needs a graphics device (autoattachGraphicsDevice)")
	}

	for i, in := range devs.Inputs {
		p := fmt.Sprintf("%s.inputs[%d]", path, i)
		if in.Type != v1.InputTypeTablet && in.Type != v1.InputTypeKeyboard {
			c.invalid(p+".type", "unknown type %q", in.Type)
		}
		bus := in.Bus
		if bus == "" {
			bus = v1.InputBusUSB
		}
		if bus != v1.InputBusUSB && bus != v1.InputBusVirtio {
			c.invalid(p+".bus", "unknown bus %q", bus)
		}
		dl.Inputs = append(dl.Inputs, libvirtxml.DomainInput{Type: string(in.Type), Bus: string(bus), Alias: userAlias(in.Name)})
	}
	if isTrue(devs.AutoattachInputDevice) && len(devs.Inputs) == 0 {
		dl.Inputs = append(dl.Inputs, libvirtxml.DomainInput{Type: "tablet", Bus: "usb"})
	}

	if notFalse(devs.AutoattachMemBalloon) {
		dl.MemBalloon = &libvirtxml.DomainMemBalloon{Model: virtioModel(transitional), FreePageReporting: "on"}
	} else {
		dl.MemBalloon = &libvirtxml.DomainMemBalloon{Model: "none"}
	}

	if devs.Rng != nil {
		dl.RNGs = append(dl.RNGs, libvirtxml.DomainRNG{
			Model:   virtioModel(transitional),
			Backend: &libvirtxml.DomainRNGBackend{Random: &libvirtxml.DomainRNGBackendRandom{Device: "/dev/urandom"}},
		})
	}

	if w := devs.Watchdog; w != nil {
		switch {
		case w.I6300ESB != nil:
			action := w.I6300ESB.Action
			switch action {
			case "":
				action = v1.WatchdogActionReset
			case v1.WatchdogActionPoweroff, v1.WatchdogActionReset, v1.WatchdogActionShutdown:
			default:
				c.invalid(path+".watchdog.i6300esb.action", "unknown action %q", action)
			}
			dl.Watchdogs = append(dl.Watchdogs, libvirtxml.DomainWatchdog{
				Model: "i6300esb", Action: string(action), Alias: userAlias(w.Name),
			})
		case w.Diag288 != nil:
			c.refuse(path+".watchdog.diag288", "not supported on x86_64")
		default:
			c.invalid(path+".watchdog", "no watchdog model")
		}
	}

	for i, p := range devs.PanicDevices {
		model := v1.Isa
		if p.Model != nil {
			model = *p.Model
		}
		switch model {
		case v1.Isa, v1.Hyperv, v1.Pvpanic:
		default:
			c.invalid(fmt.Sprintf("%s.panicDevices[%d].model", path, i), "unknown model %q", model)
		}
		dl.Panics = append(dl.Panics, libvirtxml.DomainPanic{Model: string(model)})
	}

	if s := devs.Sound; s != nil {
		model := s.Model
		if model == "" {
			model = "ich9"
		}
		if model != "ich9" && model != "ac97" {
			c.invalid(path+".sound.model", "unknown model %q", model)
		}
		dl.Sounds = append(dl.Sounds, libvirtxml.DomainSound{Model: model, Alias: userAlias(s.Name)})
	}

	if len(devs.GPUs) > 0 {
		c.refuse(path+".gpus", "not supported")
	}
	if len(devs.HostDevices) > 0 {
		c.refuse(path+".hostDevices", "not supported")
	}
	if len(devs.Filesystems) > 0 {
		c.refuse(path+".filesystems", "not supported")
	}
	if devs.ClientPassthrough != nil {
		c.refuse(path+".clientPassthrough", "not supported")
	}
	if devs.DownwardMetrics != nil {
		c.refuse(path+".downwardMetrics", "not supported")
	}
	if devs.TPM != nil && notFalse(devs.TPM.Enabled) {
		c.refuse(path+".tpm", "not supported")
	}
	if isTrue(devs.AutoattachVSOCK) {
		c.refuse(path+".autoattachVSOCK", "not supported")
	}
}
