package bridge

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Deleting a veth costs the kernel about 15 ms, nearly all of it spent after
// the device is gone: RTM_DELLINK unlists both ends (names free, ports off the
// bridge with their VLAN entries, RTM_DELLINK broadcast) under the RTNL lock,
// then the deleting task waits in rcu_barrier() before its syscall returns.
// A plugin process cannot exit while one of its threads sits in that wait, so
// the binary hands the RTM_DELLINK to a helper process (itself, re-executed)
// and answers as soon as the kernel has announced the link's removal. When
// DEL answers, the link no longer exists in any namespace; only the kernel's
// reclamation of its memory is still running, in the helper's syscall.

// unregisterEnv turns the plugin binary into the unregistration helper: its
// value is "<ifindex>" of the link to delete in the inherited netns.
const unregisterEnv = "NODEVIRT_BRIDGE_UNREGISTER"

// unregisterTimeout bounds the wait for the helper before DEL deletes the
// link itself.
const unregisterTimeout = 5 * time.Second

// IsUnregisterHelper reports whether the process was started as the helper.
func IsUnregisterHelper() bool { return os.Getenv(unregisterEnv) != "" }

// RunUnregisterHelper deletes the link named by the environment and returns
// the process exit code.
func RunUnregisterHelper() int {
	idx, err := strconv.Atoi(os.Getenv(unregisterEnv))
	if err != nil || idx <= 0 {
		return 2
	}
	err = netlink.LinkDel(&netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: idx}})
	if err != nil && !errors.Is(err, syscall.ENODEV) {
		return 1
	}
	return 0
}

// linkRemover deletes a host link by name; a missing link is success.
type linkRemover func(h *netlink.Handle, name string) error

// removeLinkViaHelper deletes the named link through a helper process and
// returns once the kernel has removed it, falling back to deleting it in line
// when the helper cannot start, fails, or does not act in time.
func removeLinkViaHelper(h *netlink.Handle, name string) error {
	l, err := linkByName(h, name)
	if err != nil || l == nil {
		return err
	}
	idx := l.Attrs().Index
	// Subscribe before the helper starts, so its RTM_DELLINK cannot be missed.
	sub, err := nl.Subscribe(unix.NETLINK_ROUTE, unix.RTNLGRP_LINK)
	if err != nil {
		return deleteLink(h, name)
	}
	defer sub.Close()
	if err := sub.SetReceiveTimeout(&unix.Timeval{Usec: 20_000}); err != nil {
		return deleteLink(h, name)
	}
	self, err := os.Executable()
	if err != nil {
		return deleteLink(h, name)
	}
	cmd := exec.Command(self)
	// One P and no GC: the helper makes a single syscall, and every thread
	// its runtime would start costs CPU the next plugin call could use.
	cmd.Env = []string{unregisterEnv + "=" + strconv.Itoa(idx), "GOMAXPROCS=1", "GOGC=off"}
	// stdio on /dev/null: the runtime reading our stdout must not wait for it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return deleteLink(h, name)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.Now().Add(unregisterTimeout)
	for {
		gone, err := linkRemovedEvent(sub, idx)
		if gone {
			return nil
		}
		if err != nil {
			// Overflow or a broken socket: ask the kernel directly.
			if _, lerr := h.LinkByIndex(idx); lerr != nil {
				return nil
			}
		}
		select {
		case <-exited:
			// The helper finished without our seeing the event (or failed):
			// whatever is left is deleted here.
			return deleteLinkIndex(h, idx, name)
		default:
		}
		if time.Now().After(deadline) {
			return deleteLinkIndex(h, idx, name)
		}
	}
}

// linkRemovedEvent reads one batch of link notifications and reports whether
// it announces the removal of link idx. A receive timeout is no error.
func linkRemovedEvent(sub *nl.NetlinkSocket, idx int) (bool, error) {
	msgs, _, err := sub.Receive()
	if err != nil {
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EWOULDBLOCK) || errors.Is(err, unix.EINTR) {
			return false, nil
		}
		return false, fmt.Errorf("link notifications: %w", err)
	}
	for _, m := range msgs {
		if m.Header.Type != unix.RTM_DELLINK || len(m.Data) < unix.SizeofIfInfomsg {
			continue
		}
		if int(nl.DeserializeIfInfomsg(m.Data).Index) == idx {
			return true, nil
		}
	}
	return false, nil
}

// deleteLinkIndex deletes link idx if it still exists.
func deleteLinkIndex(h *netlink.Handle, idx int, name string) error {
	l, err := h.LinkByIndex(idx)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) || errors.Is(err, syscall.ENODEV) {
			return nil
		}
		return fmt.Errorf("look up link %s: %w", name, err)
	}
	if err := h.LinkDel(l); err != nil && !errors.Is(err, syscall.ENODEV) {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	return nil
}
