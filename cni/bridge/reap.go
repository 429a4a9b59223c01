package bridge

import (
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// retiredPrefix names veths taken out of service and awaiting deletion.
const retiredPrefix = "nvz"

// retireVeth takes an attachment's veth out of service at once and leaves
// its unregistration to a detached `ip link delete`: deleting a veth costs
// the kernel ~20 ms of RCU grace periods, the bulk of a DEL, while taking it
// off the bridge (which drops its VLAN entries), setting it down and renaming
// both ends out of the attachment's names takes about a millisecond. When
// DEL returns nothing of the attachment carries traffic or holds a name an
// ADD could want; GC deletes retired veths a helper failed to. Without ip
// on PATH the veth is deleted before returning.
func retireVeth(hh *netlink.Handle, port, netnsPath, ifName string) error {
	l, err := linkByName(hh, port)
	if err != nil || l == nil {
		return err
	}
	ipPath, lookErr := ipBinary()
	if lookErr != nil || retiredBacklog(hh) >= maxRetired {
		// Under a burst of DELs the helpers only add processes competing
		// for the CPU; delete in line instead.
		return deleteLink(hh, port)
	}
	if err := hh.LinkSetNoMaster(l); err != nil {
		return fmt.Errorf("detach %s: %w", port, err)
	}
	if err := hh.LinkSetDown(l); err != nil {
		return fmt.Errorf("set %s down: %w", port, err)
	}
	retired := fmt.Sprintf("%s%d", retiredPrefix, l.Attrs().Index)
	if err := hh.LinkSetName(l, retired); err != nil {
		return fmt.Errorf("rename %s: %w", port, err)
	}
	if err := retireContainerEnd(netnsPath, ifName, l.Attrs().Index, retired); err != nil {
		// The peer keeps its name: delete now so a new ADD can use it.
		return deleteLink(hh, retired)
	}
	cmd := exec.Command(ipPath, "link", "delete", "dev", retired)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return deleteLink(hh, retired)
	}
	go func() { _ = cmd.Wait() }() // reap it when the caller lives on
	return nil
}

// retireContainerEnd renames the container's end of the pair (if the netns
// and the interface still exist and it is the peer of hostIndex).
func retireContainerEnd(netnsPath, ifName string, hostIndex int, retired string) error {
	cns, err := netns.GetFromPath(netnsPath)
	if err != nil {
		return nil // namespace gone: so is the peer's name
	}
	defer cns.Close()
	ch, err := netlink.NewHandleAt(cns, unix.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer ch.Close()
	c, err := linkByName(ch, ifName)
	if err != nil {
		return err
	}
	if c == nil || c.Attrs().ParentIndex != hostIndex {
		return nil
	}
	if err := ch.LinkSetDown(c); err != nil {
		return err
	}
	return ch.LinkSetName(c, retired)
}

func ipBinary() (string, error) {
	if p, err := exec.LookPath("ip"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"} {
		if _, err := exec.LookPath(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("ip not found")
}

// maxRetired bounds the veths awaiting a helper before DEL deletes in line.
const maxRetired = 4

func retiredBacklog(hh *netlink.Handle) int {
	links, err := hh.LinkList()
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return 0
	}
	n := 0
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, retiredPrefix) {
			n++
		}
	}
	return n
}

// sweepRetired deletes retired veths whose helper did not finish.
func sweepRetired() error {
	hh, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer hh.Close()
	links, err := hh.LinkList()
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return fmt.Errorf("list links: %w", err)
	}
	var errs []error
	for _, l := range links {
		if _, ok := l.(*netlink.Veth); ok && strings.HasPrefix(l.Attrs().Name, retiredPrefix) {
			errs = append(errs, deleteLink(hh, l.Attrs().Name))
		}
	}
	return errors.Join(errs...)
}
